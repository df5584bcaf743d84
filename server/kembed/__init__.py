"""kembed: a token-bucket gRPC embedding server."""

__version__ = "0.1.0"
