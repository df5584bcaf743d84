"""What every part of the host path run shares: its options, the requests, the closed loops and
bursts against a server, and a phase's figures (calls/s, latency, CPU per call, the server's own
counters)."""

from __future__ import annotations

import argparse
import itertools
import math
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import grpc

from bench import RESULTS_DIR
from bench.serving import (
    hostpath,  # the package's docstring is the command's help
    peers,
)
from bench.tools import http_loadgen, loadgen
from bench.tools.loadgen import OK, CallRecord
from bench.tools.report import (
    Samples,
    Spread,
    latency_summary,
    padding_ratio,
    percentile,
    server_tokens,
    window_rates,
    worker_figures,
)
from bench.tools.server import Server
from bench.tools.standin import model_settings
from kembed.v1 import embedder_pb2

ZERO_COST = "bench.tools.zero_cost"
PARTS = ("host_path", "rejection", "rest", "engine_bound", "storm", "spikes", "deadlines", "serve")
DEFAULT_PARTS = "host_path,rejection,rest"
SHORT_TOKENS = 16  # "one short text": the workload's shortest class
BURST_TOKENS = (64, 128)  # a burst call's texts: about 60 words each
MAX_CALLS = 1_000_000  # closed loops end on time; this only bounds a runaway
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.name
T = TypeVar("T")


class Codes(NamedTuple):
    """The outcome codes of an answered call and of a rejected one, per protocol."""

    ok: str
    rejected: str


GRPC_CODES = Codes(OK, EXHAUSTED)
HTTP_CODES = Codes("200", "429")


@dataclass(frozen=True)
class Options:
    frontends: tuple[int, ...]  # process counts of the host-path comparison
    client_processes: int
    concurrency: int  # closed-loop callers per client process
    channels: int  # per client process: SO_REUSEPORT spreads connections, not calls
    duration: float  # seconds per closed-loop phase
    warmup: float  # seconds at the start of a phase left out of the rates
    windows: int
    burst_calls: int
    burst_texts: int
    burst_rounds: int
    parts: tuple[str, ...]  # of PARTS
    name: str  # results file: bench/results/<name>.json
    storm_texts: int
    storm_concurrency: int
    storm_duration: float
    storm_multiple: float
    spike_multiples: tuple[float, ...]  # open-loop spikes: calls/s offered, times saturation's
    spike_channels: int
    spike_concurrency: int  # closed-loop callers of the spikes' saturation
    retry_after_ms: float
    give_up_s: float  # a storm client stops retrying a call this long after its arrival
    client_nice: int  # the storm's clients run this much below the server
    engine_spinners: int  # engine_bound: busy processes sharing the engine's CPU
    timeout: float
    serve_texts: tuple[int, ...]  # texts a call, one closed-loop load each (part serve)
    serve_env: tuple[str, ...]  # SETTING=VALUE for the serve part's server
    serve_ceiling: str  # bench/results/<name>.json: the in-process ceiling the serve loads are judged against
    serve_start_timeout: float  # seconds for the serve part's server to load, compile and warm up
    py_spy_seconds: float  # > 0: one more 1-text load under py-spy (part serve)
    peer_venv: Path  # Infinity's venv (part rest); without it the peer comparison is skipped
    peer_duration: float  # seconds per REST load of the peer comparison (part rest)
    peer_dtype: str  # both servers' dtype in the peer comparison: auto (each its own choice), float32, bfloat16
    model: str  # the real-model parts' model: bundled, standin (bench.tools.standin) or a folder


def frontends_setting(value: int | str) -> dict[str, str]:
    return {"frontends": str(value)}


def real_model(opts: Options) -> dict[str, str]:
    """The settings of the parts that serve a real model: ``KEMBED_FRONTENDS=auto``, the ``--model``."""
    return {**frontends_setting("auto"), **model_settings(opts.model)}


def log_file(name: str) -> Path:
    return RESULTS_DIR / f"hostpath_{name}.log"


def encode(texts: Sequence[str], per_call: int) -> list[bytes]:
    """Requests of ``per_call`` consecutive texts each (``truncate=true``), the texts reused in turn."""
    cycle = itertools.cycle(texts)
    calls = max(1, len(texts) // per_call)
    return [
        embedder_pb2.EmbedRequest(texts=list(itertools.islice(cycle, per_call)), truncate=True).SerializeToString()
        for _ in range(calls)
    ]


def _measure(server: Server, load: Callable[[], tuple[T, float]]) -> tuple[T, float, float]:
    """``load()``'s result, with the server's CPU seconds (whole process tree) and the client's over it."""
    before = server.cpu_seconds()
    result, client_cpu = load()
    return result, server.cpu_seconds() - before, client_cpu


def _span(outcomes: Sequence[CallRecord]) -> float:
    """Seconds from the first send to the last answer."""
    return max(o.done for o in outcomes) - min(o.sent for o in outcomes) if outcomes else math.nan


def rate_figures(
    outcomes: Sequence[CallRecord], texts_per_call: int, opts: Options, duration: float, codes: Codes = GRPC_CODES
) -> dict[str, Any]:
    """Calls/s and embeddings/s of the successful calls over [warmup, duration), median and range
    over ``opts.windows`` windows; latency of the successful calls; every status code counted."""
    ok = [o.done for o in outcomes if o.code == codes.ok]

    def rate(weight: float) -> dict[str, float]:
        return Spread.of(window_rates(ok, [weight] * len(ok), opts.warmup, duration, opts.windows)).to_dict()

    return {
        "calls": len(outcomes),
        "codes": dict(Counter(o.code for o in outcomes)),
        "calls_per_s": rate(1.0),
        "emb_per_s": rate(float(texts_per_call)),
        "latency_ms": latency_summary([o.latency for o in outcomes if o.code == codes.ok]),
        "rejection_latency_ms": latency_summary([o.latency for o in outcomes if o.code == codes.rejected]),
    }


def burst_figures(rounds: Sequence[Sequence[CallRecord]], code: str | None = None) -> dict[str, Any]:
    """Per burst, the p99 and the last of the answer times (from the burst's start) with status
    ``code``, or whatever the code; median and range over the bursts. ``rejected_share``: answers
    that were RESOURCE_EXHAUSTED."""
    ms = [[o.latency * 1000 for o in r if code is None or o.code == code] for r in rounds]
    ms = [r for r in ms if r]
    outcomes = [o for r in rounds for o in r]
    exhausted = sum(o.code == EXHAUSTED for o in outcomes)
    return {
        "calls": len(outcomes),
        "codes": dict(Counter(o.code for o in outcomes)),
        "rejected_share": exhausted / len(outcomes) if outcomes else math.nan,
        "p99_ms": Spread.of([percentile(r, 99) for r in ms]).to_dict(),
        "last_ms": Spread.of([max(r) for r in ms]).to_dict(),
    }


def _cores(server_cpu: float, client_cpu: float, outcomes: Sequence[CallRecord]) -> dict[str, float]:
    """Cores busy on average while the load ran: server and client share the machine."""
    span = _span(outcomes)
    return {"server": server_cpu / span, "client": client_cpu / span}


def phase_figures(
    server: Server,
    load: Callable[[], tuple[list[CallRecord], float]],
    texts_per_call: int,
    opts: Options,
    duration: float,
    codes: Codes = GRPC_CODES,
) -> dict[str, Any]:
    """One load's rates and latency, with the CPU cores and peak memory of the server over it."""
    outcomes, server_cpu, client_cpu = _measure(server, load)
    return {
        **rate_figures(outcomes, texts_per_call, opts, duration, codes),
        "cpu_cores": _cores(server_cpu, client_cpu, outcomes),
        "server_cpu_ms_per_call": _per_call(server_cpu, len(outcomes)),
        "peak_rss_mib": server.peak_rss_mib(),
        "span_s": _span(outcomes),
    }


def _per_call(cpu_s: float, calls: int) -> float:
    """Server CPU milliseconds per answered call: the cost, whatever else takes the cores."""
    return cpu_s * 1000 / calls if calls else math.nan


def grpc_closed_loop(server: Server, requests: list[bytes], opts: Options, texts_per_call: int = 1) -> dict[str, Any]:
    """The host-path load: ``client_processes`` processes of ``concurrency`` closed-loop callers."""
    kwargs = [
        {"target": server.grpc_target, "requests": requests, "concurrency": opts.concurrency,
         "duration": opts.duration, "count": count, "deadline": opts.timeout, "channels": opts.channels}
        for count in loadgen.split(MAX_CALLS, opts.client_processes)
    ]  # fmt: skip

    def load() -> tuple[list[CallRecord], float]:
        parts, cpu = loadgen.in_processes(loadgen.closed_loop, kwargs)
        return [o for part in parts for o in part], cpu

    return phase_figures(server, load, texts_per_call, opts, opts.duration)


def rest_closed_loop(server: Server, bodies: list[bytes], opts: Options, duration: float) -> dict[str, Any]:
    """The host-path load over the OpenAI API: as many client processes as ``grpc_closed_loop`` and as
    many calls in flight in each, one per keep-alive connection (HTTP/1.1 carries one at a time)."""
    url = server.rest_url + http_loadgen.EMBEDDINGS_PATH

    def load() -> tuple[list[CallRecord], float]:
        return http_loadgen.in_processes(url, bodies, opts.client_processes, opts.concurrency, duration, opts.timeout)

    return phase_figures(server, load, 1, opts, duration, HTTP_CODES)


def one_text_bodies(texts: list[str], server: Server, model: str = "") -> list[bytes]:
    """1-text ``/v1/embeddings`` bodies naming ``model``, or else the server's own model id; float
    vectors, as the peer's baseline was measured (the official client asks for base64)."""
    return http_loadgen.embeddings_bodies(texts, 1, model or server.info()["modelId"], "float")


class Senders(NamedTuple):
    """Who sends a burst: client processes, and channels (TCP connections) in each."""

    processes: int
    channels: int


ONE_CHANNEL = Senders(1, 1)


def many_senders(opts: Options) -> Senders:
    return Senders(opts.client_processes, opts.channels)


def bursts(server: Server, request: bytes, opts: Options, senders: Senders, code: str | None = None) -> dict[str, Any]:
    """``burst_rounds`` bursts of ``burst_calls`` calls, shared out over ``senders``."""
    kwargs = [
        {"target": server.grpc_target, "request": request, "calls": calls, "rounds": opts.burst_rounds,
         "deadline": opts.timeout, "channels": senders.channels}
        for calls in loadgen.split(opts.burst_calls, senders.processes)
    ]  # fmt: skip

    def load() -> tuple[list[list[CallRecord]], float]:
        parts, cpu = loadgen.in_processes(loadgen.burst, kwargs)
        return [[o for part in parts for o in part[r]] for r in range(opts.burst_rounds)], cpu

    rounds, server_cpu, _ = _measure(server, load)
    figures = burst_figures(rounds, code)
    return {**figures, "server_cpu_ms_per_call": _per_call(server_cpu, figures["calls"]),
            "peak_rss_mib": server.peak_rss_mib()}  # fmt: skip


# The short-deadline shape: real callers of 4 texts of about 40 words with 10 s deadlines; after a
# lead, careless callers of 1 text with 30 ms deadlines on a connection of their own.
DEADLINE_CALLERS, DEADLINE_TEXTS, DEADLINE_S = 24, 4, 10.0
SHORT_CALLERS, SHORT_DEADLINE_S, SHORT_LEAD_S = 48, 0.03, 12.0


def niced(job: Callable[..., Coroutine[Any, Any, list[CallRecord]]], kwargs: dict[str, Any], opts: Options
           ) -> tuple[list[CallRecord], float]:  # fmt: skip
    """One load in a client process of its own, ``client_nice`` below the server."""
    parts, cpu = loadgen.in_processes(job, [kwargs], nice=opts.client_nice)
    return parts[0], cpu


def counter_figures(before: Samples, after: Samples, span_s: float) -> dict[str, Any]:
    """From the server's own counters over a load: padding, and the worker's busy share, padded
    tokens per compute-second and rows per batch."""
    real, padding = server_tokens(before, after)
    return {"padding_ratio": padding_ratio(real, padding), "worker": worker_figures(before, after, span_s)}


def calls_text(figures: dict[str, Any]) -> str:
    return f"{figures['calls_per_s']['median']:.0f}"


def parse_options(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=hostpath.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=DEFAULT_PARTS, help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--frontends", default="1", help="process counts to compare, e.g. 1,2")
    parser.add_argument("--name", default="hostpath", help="write bench/results/NAME.json")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop callers per client process")
    parser.add_argument("--channels", type=int, default=4, help="channels (TCP connections) per client process")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per host-path phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds at the start of a phase not counted")
    parser.add_argument("--windows", type=int, default=4, help="time windows per phase, for the spread")
    parser.add_argument("--burst-calls", type=int, default=600)
    parser.add_argument("--burst-texts", type=int, default=8, help="texts per burst call")
    parser.add_argument("--burst-rounds", type=int, default=5, help="bursts per server, one after the other")
    parser.add_argument("--storm-texts", type=int, default=16, help="texts per retry-storm call")
    parser.add_argument("--storm-concurrency", type=int, default=24, help="closed-loop clients for the saturation")
    parser.add_argument("--storm-duration", type=float, default=20.0, help="seconds per retry-storm phase")
    parser.add_argument("--storm-multiple", type=float, default=3.0, help="calls/s offered, times saturation's")
    parser.add_argument("--spike-multiples", default="2,4", help="open-loop spikes: calls/s, times saturation's")
    parser.add_argument("--spike-channels", type=int, default=4, help="open-loop spikes: channels (a pool)")
    parser.add_argument("--spike-concurrency", type=int, default=96, help="spikes: closed-loop callers, saturation")
    parser.add_argument("--retry-after-ms", type=float, default=10.0, help="storm clients retry this soon")
    parser.add_argument("--give-up-s", type=float, default=8.0, help="storm clients give a call up this long after it")
    parser.add_argument("--client-nice", type=int, default=19, help="storm clients' niceness, added to ours")
    parser.add_argument("--engine-spinners", type=int, default=7, help="engine_bound: busy processes on its CPU")
    parser.add_argument("--timeout", type=float, default=30.0, help="client deadline per call, seconds")
    parser.add_argument("--serve-texts", default="1,16", help="serve: texts a call, one load each")
    parser.add_argument("--serve-env", action="append", default=[], metavar="SETTING=VALUE", help="serve: a setting")
    parser.add_argument("--serve-ceiling", default="", help="serve: judge against bench/results/NAME.json")
    parser.add_argument("--serve-start-timeout", type=float, default=600.0, help="serve: seconds to become ready")
    parser.add_argument("--py-spy-seconds", type=float, default=0.0, help="serve: > 0 adds a load under py-spy")
    parser.add_argument(
        "--peer-venv", type=Path, default=peers.VENV, help="rest: Infinity's venv (bench.serving.peers)"
    )
    parser.add_argument("--peer-duration", type=float, default=20.0, help="rest: seconds per peer-comparison load")
    parser.add_argument("--peer-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="rest: both servers' dtype (auto: each its own choice)")  # fmt: skip
    parser.add_argument("--model", default="bundled", help="real-model parts: bundled, standin or a folder")
    args = parser.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    if not 0 <= args.warmup < min(args.duration, args.peer_duration):
        parser.error("--warmup: must be at least 0 and below --duration and --peer-duration")
    frontends = tuple(int(n) for n in args.frontends.split(",") if n)
    serve_texts = tuple(int(n) for n in args.serve_texts.split(",") if n)
    spike_multiples = tuple(float(x) for x in args.spike_multiples.split(",") if x)
    fields = {"frontends": frontends, "parts": parts, "serve_texts": serve_texts, "serve_env": tuple(args.serve_env),
              "spike_multiples": spike_multiples}  # fmt: skip
    return Options(**{**vars(args), **fields})  # the flags are the fields
