"""Load a real kembed server over loopback gRPC and report what it delivers.

1. Start ``python -m kembed`` (``--batching token_bucket`` or ``naive``) on free loopback ports.
2. Capacity: a closed loop of ``--concurrency`` clients at saturation.
3. Open loop: Poisson arrivals at 0.5x, 1x, 2x and 4x that capacity (or of ``--capacity``, so two
   strategies can be offered the same absolute loads).

Each request is one workload text (``truncate=true``), or ``--texts-per-call`` consecutive ones
(written to ``serve_<batching>_<n>texts.json``, capacity only by default). Per phase: embeddings/s and tokens/s
delivered (median and range over time windows), p50/p95/p99 latency of accepted requests,
rejection rate and rejection latency, padding ratio from the server's ``kembed_tokens_total``,
the server's peak resident memory, and the CPU the server and this client used. Writes
``bench/results/serve_<batching>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from bench import RESULTS_DIR
from bench.tools import machine, workload
from bench.tools.loadgen import OK, REJECTED, CallRecord, closed_loop, open_loop
from bench.tools.report import (
    Samples,
    Spread,
    deltas_by_label,
    latency_summary,
    padding_ratio,
    server_tokens,
    window_rates,
    worker_figures,
)
from bench.tools.server import Server, running
from kembed.config.settings import Settings
from kembed.contract import Metric, env_name
from kembed.v1 import embedder_pb2

T = TypeVar("T")


@dataclass(frozen=True)
class Options:
    batching: str
    concurrency: int
    duration: float  # seconds per phase
    warmup: float  # seconds at the start of a phase left out of the rates
    windows: int  # slices of a phase whose rates give the spread
    timeout: float
    max_requests: int
    seed: int
    settle: float  # idle seconds before a phase, so the server's latency window forgets the last one
    texts_per_call: int = 1

    @property
    def name(self) -> str:
        return f"serve_{self.batching}" + (f"_{self.texts_per_call}texts" if self.texts_per_call > 1 else "")


def per_call_groups(items: Sequence[T], per_call: int) -> list[Sequence[T]]:
    """Runs of ``per_call`` consecutive items, one a call (the last partial run left out)."""
    return [items[i : i + per_call] for i in range(0, len(items) - per_call + 1, per_call)]


def encode_requests(texts: Sequence[str], per_call: int = 1) -> list[bytes]:
    calls = per_call_groups(texts, per_call)
    return [embedder_pb2.EmbedRequest(texts=list(call), truncate=True).SerializeToString() for call in calls]


def summarize(
    outcomes: list[CallRecord], tokens: Sequence[int], opts: Options, before: Samples, after: Samples
) -> dict[str, Any]:
    """One phase's figures; rates over [warmup, duration) so ramp-up and the drained tail are out."""
    ok = [o for o in outcomes if o.code == OK]
    rejected = [o for o in outcomes if o.code in REJECTED]

    def rate(weights: Sequence[float]) -> Spread:
        return Spread.of(window_rates([o.done for o in ok], weights, opts.warmup, opts.duration, opts.windows))

    real, padding = server_tokens(before, after)
    return {
        "sent": len(outcomes),
        "codes": dict(Counter(o.code for o in outcomes)),
        "emb_per_s": rate([float(opts.texts_per_call)] * len(ok)).to_dict(),
        "tokens_per_s": rate([tokens[o.item % len(tokens)] for o in ok]).to_dict(),
        "latency_ms": latency_summary([o.latency for o in ok]),
        "rejection_rate": len(rejected) / len(outcomes) if outcomes else 0.0,
        "rejection_latency_ms": latency_summary([o.latency for o in rejected]),
        "client_lag_ms_p99": latency_summary([o.sent - o.scheduled for o in outcomes])["p99"],
        "server_tokens": {"real": real, "padding": padding},
        "server_rejections": deltas_by_label(before, after, Metric.REJECTED + "_total", "reason"),
        "padding_ratio": padding_ratio(real, padding),
    }


def _clocks(server: Server) -> tuple[float, float, float]:
    """Seconds of wall time, of the server's CPU and of this client's CPU (all threads)."""
    return time.perf_counter(), server.cpu_seconds(), time.process_time()


async def _phase(server: Server, requests: list[bytes], tokens: list[int], opts: Options, rate: float) -> dict:
    """One closed-loop (rate 0) or open-loop phase, with the server's counters around it."""
    await asyncio.sleep(opts.settle)
    before = await asyncio.to_thread(server.metrics)
    start = _clocks(server)
    target, count = server.grpc_target, opts.max_requests
    if rate:
        outcomes = await open_loop(target, requests, rate, opts.duration, count, opts.seed, opts.timeout)
    else:
        outcomes = await closed_loop(target, requests, opts.concurrency, opts.duration, count, opts.timeout)
    wall, server_cpu, client_cpu = (b - a for a, b in zip(start, _clocks(server), strict=True))
    after = await asyncio.to_thread(server.metrics)
    summary = summarize(outcomes, tokens, opts, before, after)
    # Cores busy on average: the server and this client share the machine's cores.
    summary["cpu_cores"] = {"server": server_cpu / wall, "client": client_cpu / wall}
    summary["worker"] = worker_figures(before, after, wall)
    summary["peak_rss_mib"] = server.peak_rss_mib()
    return summary


async def _run(server: Server, opts: Options, loads: list[float], capacity: float) -> dict[str, Any]:
    wl = workload.load()
    per_call = opts.texts_per_call
    requests = encode_requests(wl.texts, per_call)
    clipped = [min(t, workload.BUCKETS[-1]) for t in wl.tokens]
    tokens = [sum(call) for call in per_call_groups(clipped, per_call)]
    result: dict[str, Any] = {"server_info": server.info(), **server.served()}
    print(f"{opts.name}: capacity, closed loop x{opts.concurrency}, {per_call} texts a call, {opts.duration:.0f} s")
    result["saturation"] = await _phase(server, requests, tokens, opts, rate=0)
    saturated = result["saturation"]["emb_per_s"]["median"]
    print(f"  saturation: {saturated:.1f} emb/s")
    base = capacity or saturated
    result["offered_base_emb_per_s"] = base
    result["open_loop"] = []
    for multiple in loads:
        print(f"  open loop {multiple}x = {multiple * base:.1f} req/s, {opts.duration:.0f} s")
        phase = await _phase(server, requests, tokens, opts, rate=multiple * base / per_call)
        result["open_loop"].append({"offered_x": multiple, "offered_rps": multiple * base, **phase})
        print(f"    {phase['emb_per_s']['median']:.1f} emb/s, p95 {phase['latency_ms']['p95']:.0f} ms, "
              f"rejected {phase['rejection_rate']:.0%}")  # fmt: skip
    result["workload"] = wl.describe()
    return result


def _settings(settings: dict[str, str]) -> Settings:
    return Settings.from_env({env_name(k): v for k, v in settings.items()})


def run(opts: Options, loads: list[float], capacity: float = 0.0, env: dict[str, str] | None = None) -> dict:
    """Start the server, measure, stop it; write ``<opts.name>.json``."""
    settings = {"batching": opts.batching, **(env or {})}
    configured = _settings(settings)  # the budget the 4x phase is judged against
    with running(settings, RESULTS_DIR / f"{opts.name.replace('serve', 'server', 1)}.log") as server:
        result = asyncio.run(_run(server, opts, loads, capacity))
    result.update(batching=opts.batching, options=asdict(opts), max_drain_ms=configured.max_drain_ms, env=settings)
    machine.write_result(opts.name, result)
    return result


def main(argv: Sequence[str] | None = None) -> float:
    """Run from the command line; returns the emb/s the open-loop multiples were of."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batching", default="token_bucket", choices=["token_bucket", "naive"])
    parser.add_argument(
        "--loads",
        default=None,
        help="multiples of capacity to offer, open loop; default 0.5,1,2,4 (none with --texts-per-call)",
    )
    parser.add_argument("--texts-per-call", type=int, default=1, help="consecutive workload texts in each call")
    parser.add_argument("--capacity", type=float, default=0.0, help="emb/s the multiples are of; 0 = measured here")
    parser.add_argument("--concurrency", type=int, default=96, help="closed-loop clients for the capacity phase")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds at the start of a phase not counted")
    parser.add_argument("--windows", type=int, default=4, help="time windows per phase, for the spread")
    parser.add_argument("--timeout", type=float, default=30.0, help="client deadline per request, seconds")
    parser.add_argument("--max-requests", type=int, default=20_000, help="cap on requests per phase")
    parser.add_argument("--seed", type=int, default=workload.SEED)
    parser.add_argument("--settle", type=float, default=-1, help="idle s between phases; -1 = server latency window")
    parser.add_argument("--env", action="append", default=[], metavar="SETTING=VALUE", help="extra server setting")
    args = parser.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.env)
    settle = args.settle if args.settle >= 0 else _settings({"batching": args.batching, **env}).latency_window_s
    opts = Options(
        args.batching, args.concurrency, args.duration, args.warmup, args.windows, args.timeout,
        args.max_requests, args.seed, settle, args.texts_per_call,
    )  # fmt: skip
    loads = args.loads if args.loads is not None else ("0.5,1,2,4" if args.texts_per_call == 1 else "")
    result = run(opts, [float(x) for x in loads.split(",") if x], args.capacity, env)
    return float(result["offered_base_emb_per_s"])


if __name__ == "__main__":
    main()
