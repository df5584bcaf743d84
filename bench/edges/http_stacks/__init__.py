"""Which HTTP stack for kembed's REST edge, measured beside the bare gRPC echo: ``python -m bench.edges.http_stacks``.

Each candidate of ``bench.edges.http_edges`` runs in a server process of its own (its HTTP server and an
idle ``grpc.aio`` server on one loop, as a front end would host them), and so does the gRPC echo,
the yardstick. Per ``--repeats`` round, every server in turn is started (time to ready, memory),
checked (one real reply of each encoding), then loaded closed loop with one short text a call by
h2load (nghttp2's C client: HTTP/1.1 keep-alive for the stacks, h2c for gRPC, so one neutral
client drives both), ``--connections`` connections with one call in flight each: a warm-up run,
then ``--duration`` s measured. Per load: calls/s, latency percentiles (h2load's per-request
log), the server's CPU milliseconds per call (/proc, all its threads) and the client's CPU.

The front-end budget: kembed's own per-call work, ``W`` (zero-cost kembed's CPU per call minus
the echo's, from ``bench/results/hostpath.json``), comes on top of either protocol, so the REST
edge keeps ``(grpc + W) / (stack + W)`` of gRPC's calls/s on a CPU-bound front end; the target is
>= 0.8.

Then, once per stack, with short limits: does it answer an oversized body 413, close an idle
keep-alive connection, close a slowloris connection (headers trickled a byte at a time), and let
a request in flight finish on SIGTERM?

Writes ``bench/results/http_stacks.json`` and the table in ``bench/README.md``. Needs h2load
(Debian: ``apt-get install nghttp2-client``). Run it on a quiet machine.
"""
