"""Every benchmark, in order, then the plots and the README tables: ``python -m bench.run_all``.

1. the ceiling (sorted and arrival order), in one process, in the dtype the server would serve in,
   with, on a CPU, sentence-transformers' own encode and kembed's model eager and compiled in the
   server's lanes (``limits``) and the batch curve; then the eager batcher's policy on a simulated
   clock under that curve's cost model (``bench.compute.packing``: packed against bucket-confined batches);
2. start-up (``bench.serving.startup``): ready after start with an empty compile cache, then a warm one;
3. the server with token-bucket batching and the default settings: its saturation with 32 callers
   of one text, then 0.5x..4x of it, open loop; and its saturation at 16 texts a call, 16 callers;
4. the same server with ``KEMBED_BATCHING=naive``, offered the same absolute loads;
5. the GPU extras (``bench.compute.gpu``), which skip cleanly without CUDA;
6. the host path against a bare gRPC echo (``bench.serving.hostpath``): zero-cost server, rejection cost,
   REST against gRPC and against the peer (Infinity, where ``bench.serving.peers setup`` installed it), and
   (not with ``--quick``) the overload shapes: the retry storm on one channel, open-loop spikes at
   2x and 4x over 4 channels, and the exported P95 beside 30 ms callers;
7. queries beside an ingest, the priority classes (``bench.serving.priority``);
8. pings beside a hostile client (``bench.serving.abuse``);
9. admission one client cannot game (``bench.serving.fairness``): queries beside a maximal ingest, and the
   exported P95 beside refused maximal requests;
10. a corpus job's shards beside queries (``bench.serving.corpus``);
11. the front end → engine transports (``bench.edges.ipc``);
12. ``bench.plot``.

The ceiling's *bucketed* batching uses a finer bucket ladder than the server's default powers of
two: on this workload, in bucket-confined batches (compiled shapes), the defaults pad about 27% of
computed tokens, the ladder about 13% (``TUNED_BUCKETS``). The server runs with the default
settings, as the targets are set: packed eager batches cross buckets, and the ladder matters
little there (``bench.compute.packing``). The naive baseline has no buckets.

Run it on a quiet machine: the server and the load generator share its cores with everyone else.
``--quick`` checks the pipeline end to end in a few minutes; its figures mean nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from bench import plot
from bench.compute import ceiling, gpu, packing
from bench.edges import ipc
from bench.serving import abuse, corpus, fairness, priority, serve_load, startup
from bench.serving.hostpath import measure as hostpath_measure
from bench.serving.hostpath import run as hostpath

TUNED_BUCKETS = "buckets=16,24,32,48,64,96,128,192,256"
HOSTPATH = ["--parts", f"{hostpath_measure.DEFAULT_PARTS},storm,spikes,deadlines"]
QUICK_HOSTPATH = ["--duration", "5", "--warmup", "1", "--windows", "2", "--burst-rounds", "2", "--peer-duration", "5"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short phases and few texts: a pipeline check only")
    parser.add_argument("--skip-gpu", action="store_true")
    args = parser.parse_args(argv)
    quick_ceiling = ["--texts", "256", "--repeats", "1", "--limits-rounds", "4"]
    ceiling.main(["--env", TUNED_BUCKETS, *(quick_ceiling if args.quick else [])])
    packing.main(["--ceiling", "ceiling", *(["--batches", "300"] if args.quick else [])])
    serve = ["--duration", "8", "--warmup", "2", "--windows", "2", "--settle", "2"] if args.quick else []
    startup.main([])
    capacity = serve_load.main(["--batching", "token_bucket", "--concurrency", "32", *serve])
    serve_load.main(["--texts-per-call", "16", "--concurrency", "16", *serve])
    serve_load.main(["--batching", "naive", "--capacity", str(capacity), *serve])
    if not args.skip_gpu:
        gpu.main(["--quick"] if args.quick else [])
    hostpath.main(QUICK_HOSTPATH if args.quick else HOSTPATH)
    quick_loads = ["--duration", "8", "--warmup", "2", "--windows", "2"]
    priority.main(quick_loads if args.quick else [])
    abuse.main(["--duration", "5", "--settle", "1"] if args.quick else [])
    fairness.main(["--duration", "8", "--lockout-texts", "64"] if args.quick else [])
    corpus.main(quick_loads if args.quick else [])
    ipc.main(["--seconds", "1"] if args.quick else [])
    plot.main()


if __name__ == "__main__":
    main()
