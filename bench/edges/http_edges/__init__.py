"""Candidate HTTP stacks for kembed's REST edge, each as a front end would host it.

``python -m bench.edges.http_edges``.

One process per run: a ``grpc.aio`` server (the ``bench.tools.echo`` handler, idle on a port of its
own) and the stack's HTTP server on one asyncio loop, the HTTP server on a prebound socket with
SO_REUSEPORT, as N front ends would share the REST port. Every stack answers ``POST
/v1/embeddings`` through the same code (``answer``: orjson parse, a check of each field, and an
OpenAI-shaped reply of one precomputed 384-float embedding per text, as floats or base64), so the
stacks differ only in what they cost between the socket and that code. ``--stack grpc`` runs the
bare gRPC echo on the measured port instead, with no HTTP server: the yardstick.

Each stack is configured with the same limits (``Limits``) where it can enforce them; what each
cannot is what ``bench.edges.http_stacks`` probes. On SIGTERM the process stops accepting, lets
requests in flight finish within the drain time, and exits 0.

    python -m bench.edges.http_edges --stack httptools --port 8080 --ready-file /tmp/ready
"""
