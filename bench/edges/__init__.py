"""Which stack and transport for the server's edges: candidate HTTP stacks for the REST edge beside
the bare gRPC echo, and the front end to engine transports."""
