"""The host path, judged side by side with a bare gRPC echo in one run: ``python -m bench.serving.hostpath``.

1. **Host path.** The same closed-loop load (``--client-processes`` processes of ``--concurrency``
   callers, one short text a call) against ``bench.tools.echo`` with N processes, then against
   ``bench.tools.zero_cost`` (kembed whose model returns zeros at once) with ``KEMBED_FRONTENDS=N``:
   calls/s of each, and their ratio. Target for N=1: >= 0.5.
2. **Rejection cost.** Bursts of ``--burst-calls`` calls of ``--burst-texts`` texts of 64-128 tokens
   (about 60 words) fired at once, against the echo (1 process), then against two kembeds: *idle*,
   ``KEMBED_MAX_QUEUED_TOKENS=1`` and ``KEMBED_FRONTENDS=1``, which rejects every call at its
   admission pre-screen (the host path's cost of a rejection; a queue cap below any request, since
   the drain rule admits a request with nothing ahead of it, whose compute would share the cores
   with the burst), and *computing*, the real model with default settings and
   ``KEMBED_FRONTENDS=auto``, which admits what fits its drain budget and rejects the rest while the
   engine computes what it admitted. Each burst is shared out over the client processes and their
   channels, and, to the echo and the computing kembed, sent again over one channel of one process
   (600 calls on one connection: none could have heard a refusal before it was sent, so none may be
   held for its pushback). Per burst the p99 of the answers (the rejected ones, for *computing*) and
   the time to the last; their ratios to the echo's for the same burst; the calls held for their
   pushback. Targets: <= 2x, with every *idle* answer RESOURCE_EXHAUSTED.
3. **Retry storm** (part ``storm``; the real model, ``KEMBED_FRONTENDS=auto``). ``--storm-texts``
   texts of the workload a call: the server's saturation with ``--storm-concurrency`` closed-loop clients
   that respect its pushback, then ``--storm-multiple`` times those calls/s offered open loop by
   clients that ignore the pushback, send every rejected call again ``--retry-after-ms`` later and
   give up ``--give-up-s`` after its arrival: goodput (embeddings/s of successful calls) over
   saturation, how long a rejection took, and how many calls gave up (against the fewest that
   must: what saturation cannot serve before they give up). Target: >= 0.9. Storm clients run
   ``--client-nice`` below the server: in production they are on other machines.

4. **REST** (part ``rest``). One zero-cost server, ``KEMBED_FRONTENDS=1``: the host-path load over
   gRPC, then the same over its OpenAI API (``bench.tools.http_loadgen``: as many client processes, each
   with ``--concurrency`` keep-alive connections, so as many calls in flight; HTTP/1.1 carries one
   call at a time on a connection, where gRPC multiplexes its callers over ``--channels``): calls/s
   and server CPU per call of each. Target: REST >= 0.8 of gRPC. Then the peer, where its venv is
   (``python -m bench.serving.peers setup``; else skipped, with why): Infinity, then kembed with the real
   model (``KEMBED_FRONTENDS=auto``, default settings), each under that REST load for
   ``--peer-duration`` s. Target: kembed >= 2x Infinity's calls/s.

5. **Engine-bound** (part ``engine_bound``). One zero-cost server, ``KEMBED_FRONTENDS=1``, with the
   engine's threads sharing the last CPU with ``--engine-spinners`` busy processes, so that its event
   loop, not the front end, is the limit, as on a GPU host whose front ends outnumber the engine's one
   loop; the front end and the client processes run on the other CPUs. The host-path load: calls/s,
   CPU per call of the engine and of the front end, rows per batch. No target: it shows what the
   frames' clocking by the engine lets through (docs/decisions/frame-interval.md).

``KEMBED_FRONTENDS`` is always set: N, or 1, where a process count is compared (``auto`` never
picks it), and ``auto`` for the storm (what a pod runs); a server that does not know the setting
fails loudly. Writes
``bench/results/hostpath.json``; server logs go to ``bench/results/hostpath_*.log``.

Part ``serve`` (the GPU targets; the real model with ``KEMBED_FRONTENDS=auto``, what a pod runs, and
any ``--serve-env SETTING=VALUE``): one server, the host-path closed loop at each of ``--serve-texts``
texts a call (the whole workload in turn, ``truncate=true``), the server's latency window between
loads; per load embeddings/s, latency, the worker's own figures from the server's counters, and GPU
busy (nvidia-smi every 0.5 s over the load's last duration - warmup seconds, where there is one).
``--serve-ceiling NAME`` judges the loads against the in-process ceiling in
``bench/results/NAME.json`` (``python -m bench.compute.ceiling --device cuda --name NAME`` just before, on
the same machine). ``--py-spy-seconds S`` adds one more 1-text load, not counted, with ``py-spy
record`` on every server process (``pyspy_<pid>.txt``). Targets, on CUDA only: 1 text a call
>= 15,000 emb/s with accepted p95 <= 100 ms; 16 texts a call >= 25,000 emb/s and >= 0.55 of the
compiled ceiling; GPU busy >= 50% under each load.
"""
