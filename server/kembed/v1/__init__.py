"""Generated gRPC code for kembed.v1 (``make proto``; generated, not committed)."""
