"""Front ends: N processes on the gRPC and REST ports. Each edge maps its wire format to one domain call
(``call.py``), which the service validates, pre-screens, tokenizes, admits and forwards to the engine."""
