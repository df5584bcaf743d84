"""Front ends: N processes on one gRPC port that validate, tokenize, pre-screen and forward to the engine."""
