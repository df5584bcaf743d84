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

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import grpc

from bench import RESULTS_DIR, headline
from bench.serving import peers
from bench.tools import http_loadgen, loadgen, machine, workload
from bench.tools.loadgen import OK, CallRecord
from bench.tools.report import (
    Samples,
    Spread,
    deltas_by_label,
    latency_summary,
    metric_delta,
    metric_sum,
    padding_ratio,
    percentile,
    server_tokens,
    window_rates,
    worker_figures,
)
from bench.tools.server import Server, echo_running, process_tree, running
from kembed.config import Settings
from kembed.contract import Metric, env_name
from kembed.v1 import embedder_pb2

ZERO_COST = "bench.tools.zero_cost"
PARTS = ("host_path", "rejection", "rest", "storm", "spikes", "deadlines", "serve")
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
    timeout: float
    serve_texts: tuple[int, ...]  # texts a call, one closed-loop load each (part serve)
    serve_env: tuple[str, ...]  # SETTING=VALUE for the serve part's server
    serve_ceiling: str  # bench/results/<name>.json: the in-process ceiling the serve loads are judged against
    serve_start_timeout: float  # seconds for the serve part's server to load, compile and warm up
    py_spy_seconds: float  # > 0: one more 1-text load under py-spy (part serve)
    peer_venv: Path  # Infinity's venv (part rest); without it the peer comparison is skipped
    peer_duration: float  # seconds per REST load of the peer comparison (part rest)
    peer_dtype: str  # both servers' dtype in the peer comparison: auto (each its own choice), float32, bfloat16


def frontends_setting(value: int | str) -> dict[str, str]:
    return {"frontends": str(value)}


def _log(name: str) -> Path:
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


def _phase(
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


def _closed_loop(server: Server, requests: list[bytes], opts: Options, texts_per_call: int = 1) -> dict[str, Any]:
    """The host-path load: ``client_processes`` processes of ``concurrency`` closed-loop callers."""
    kwargs = [
        {"target": server.grpc_target, "requests": requests, "concurrency": opts.concurrency,
         "duration": opts.duration, "count": count, "deadline": opts.timeout, "channels": opts.channels}
        for count in loadgen.split(MAX_CALLS, opts.client_processes)
    ]  # fmt: skip

    def load() -> tuple[list[CallRecord], float]:
        parts, cpu = loadgen.in_processes(loadgen.closed_loop, kwargs)
        return [o for part in parts for o in part], cpu

    return _phase(server, load, texts_per_call, opts, opts.duration)


def _rest_closed_loop(server: Server, bodies: list[bytes], opts: Options, duration: float) -> dict[str, Any]:
    """The host-path load over the OpenAI API: as many client processes as ``_closed_loop`` and as
    many calls in flight in each, one per keep-alive connection (HTTP/1.1 carries one at a time)."""
    url = server.rest_url + http_loadgen.EMBEDDINGS_PATH

    def load() -> tuple[list[CallRecord], float]:
        return http_loadgen.in_processes(url, bodies, opts.client_processes, opts.concurrency, duration, opts.timeout)

    return _phase(server, load, 1, opts, duration, HTTP_CODES)


def _one_text_bodies(texts: list[str], server: Server, model: str = "") -> list[bytes]:
    """1-text ``/v1/embeddings`` bodies naming ``model``, or else the server's own model id; float
    vectors, as the peer's baseline was measured (the official client asks for base64)."""
    return http_loadgen.embeddings_bodies(texts, 1, model or server.info()["modelId"], "float")


class Senders(NamedTuple):
    """Who sends a burst: client processes, and channels (TCP connections) in each."""

    processes: int
    channels: int


ONE_CHANNEL = Senders(1, 1)


def _many(opts: Options) -> Senders:
    return Senders(opts.client_processes, opts.channels)


def _bursts(server: Server, request: bytes, opts: Options, senders: Senders, code: str | None = None) -> dict[str, Any]:
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


def host_path(opts: Options, short_texts: list[str]) -> list[dict[str, Any]]:
    """Echo with N processes, then the zero-cost server with N front ends, for each N."""
    requests = encode(short_texts, 1)
    pairs = []
    for n in opts.frontends:
        with echo_running(n, _log(f"echo_{n}")) as echo:
            echo_figures = _closed_loop(echo, requests, opts)
        with running(frontends_setting(n), _log(f"zero_cost_{n}"), module=ZERO_COST) as server:
            server_figures = _closed_loop(server, requests, opts)
        pairs.append({"processes": n, "echo": echo_figures, "zero_cost": server_figures})
        print(f"  host path, {n} process(es): echo {_calls(echo_figures)}, zero-cost {_calls(server_figures)} calls/s")
    return pairs


def rest(opts: Options, short_texts: list[str]) -> dict[str, Any]:
    """gRPC, then REST, against one zero-cost server with one front end; then the peer comparison."""
    settings = frontends_setting(1)
    with running(settings, _log("rest_zero_cost"), module=ZERO_COST) as server:
        grpc_figures = _closed_loop(server, encode(short_texts, 1), opts)
        rest_figures = _rest_closed_loop(server, _one_text_bodies(short_texts, server), opts, opts.duration)
    print(f"  REST, zero-cost server, 1 front end: gRPC {_calls(grpc_figures)}, REST {_calls(rest_figures)} calls/s")
    host = {"settings": settings, "grpc": grpc_figures, "rest": rest_figures}
    return {"host_path": host, "peer": rest_peer(opts, short_texts)}


def rest_peer(opts: Options, short_texts: list[str]) -> dict[str, Any]:
    """Infinity, then kembed with the real model (what a pod runs), each under the same REST load;
    without Infinity's venv, why it was skipped and the command that sets it up."""
    if not peers.installed(opts.peer_venv):
        command = peers.setup_command(opts.peer_venv)
        print(f"  REST peer: skipped, no Infinity in {opts.peer_venv}; set it up with: {command}")
        return {"skipped": f"no Infinity in {opts.peer_venv}", "setup_command": command}
    exe = peers.setup(opts.peer_venv)  # installs nothing here: it checks the venv's torch is the CPU one
    with peers.infinity_running(exe, _log("rest_infinity"), dtype=opts.peer_dtype) as server:
        infinity = _rest_closed_loop(server, _one_text_bodies(short_texts, server, peers.MODEL_NAME), opts,
                                     opts.peer_duration)  # fmt: skip
    settings = {**frontends_setting("auto"), "dtype": opts.peer_dtype}
    with running(settings, _log("rest_kembed"), module="kembed") as server:
        before = server.metrics()
        kembed = _rest_closed_loop(server, _one_text_bodies(short_texts, server), opts, opts.peer_duration)
        kembed.update(_counters(before, server.metrics(), kembed["span_s"]), **server.served())
    infinity["dtype"] = peers.infinity_dtype(opts.peer_dtype)
    worker = kembed["worker"]
    print(f"  REST, real model: Infinity {_calls(infinity)}, kembed {_calls(kembed)} calls/s (kembed's worker busy "
          f"{worker['busy_share']:.0%}, padding {kembed['padding_ratio']:.0%}, {worker['rows_per_batch']:.1f} rows "
          "a batch)")  # fmt: skip
    return {"peer": peers.PEER, "settings": settings, "infinity": infinity, "kembed": kembed}


def rejection(opts: Options, texts: list[str]) -> dict[str, Any]:
    """The same bursts against the echo (1 process), a kembed that rejects every call on an idle
    engine, and a kembed that rejects what its drain budget cannot hold while it computes the rest;
    each burst sent over many channels, and, to the echo and the computing kembed, over one."""
    request = encode(texts[: opts.burst_texts], opts.burst_texts)[0]
    with echo_running(1, _log("echo_burst")) as echo:
        echo_figures = _bursts(echo, request, opts, _many(opts))
        echo_one = _bursts(echo, request, opts, ONE_CHANNEL)
    idle_settings = {**frontends_setting(1), "max_queued_tokens": "1"}
    with running(idle_settings, _log("rejecting"), module="kembed") as server:
        idle = _rejecting_bursts(server, request, opts, _many(opts))
    computing_settings = frontends_setting("auto")
    with running(computing_settings, _log("computing"), module="kembed") as server:
        computing = _rejecting_bursts(server, request, opts, _many(opts), code=EXHAUSTED)
        computing_one = _rejecting_bursts(server, request, opts, ONE_CHANNEL, code=EXHAUSTED)
    shown = (("echo", echo_figures), ("kembed, idle engine", idle), ("kembed, engine computing", computing),
             ("echo, one channel", echo_one), ("kembed, engine computing, one channel", computing_one))  # fmt: skip
    for name, f in shown:
        p99, last = f["p99_ms"]["median"], f["last_ms"]["median"]
        print(f"  burst, {name}: p99 {p99:.0f} ms, last {last:.0f} ms, codes {f['codes']}, "
              f"server {f['server_cpu_ms_per_call']:.2f} CPU ms/call")  # fmt: skip
    return {"echo": echo_figures, "kembed": idle, "computing": computing,
            "one_channel": {"echo": echo_one, "computing": computing_one},
            "settings": {"idle": idle_settings, "computing": computing_settings}}  # fmt: skip


def _rejecting_bursts(
    server: Server, request: bytes, opts: Options, senders: Senders, code: str | None = None
) -> dict[str, Any]:
    """Bursts against a kembed, with which admission rule said no and how many refusals were
    answered late for their client's refusal rate (from the server's own counters)."""
    before = server.metrics()
    figures = _bursts(server, request, opts, senders, code)
    after = server.metrics()
    figures["server_rejections"] = deltas_by_label(before, after, Metric.REJECTED + "_total", "reason")
    figures["refusals_paced"] = metric_delta(before, after, Metric.REFUSALS_PACED + "_total")
    return figures


def retry_storm(opts: Options, texts: list[str]) -> dict[str, Any]:
    """Saturation with pushback-respecting clients, then a multiple of its calls/s offered by
    clients that retry every rejection ``retry_after_ms`` later until they give up; the real model,
    ``frontends=auto``; the clients ``client_nice`` below the server, in a process of their own."""
    requests = encode(texts, opts.storm_texts)
    with running(frontends_setting("auto"), _log("storm"), module="kembed") as server:
        target = server.grpc_target
        saturate = {"target": target, "requests": requests, "concurrency": opts.storm_concurrency,
                    "duration": opts.storm_duration, "count": MAX_CALLS, "deadline": opts.timeout}  # fmt: skip
        saturation = _phase(server, lambda: _niced(loadgen.closed_loop, saturate, opts), opts.storm_texts, opts,
                            opts.storm_duration)  # fmt: skip
        print(f"  retry storm: saturation {saturation['emb_per_s']['median']:.1f} emb/s")
        time.sleep(Settings.from_env({}).latency_window_s)  # the server's latency window forgets saturation
        rate = opts.storm_multiple * saturation["calls_per_s"]["median"]
        if not rate > 0:
            raise RuntimeError(f"retry storm: no call succeeded at saturation ({saturation['codes']})")
        flood = {"target": target, "requests": requests, "rate": rate, "duration": opts.storm_duration,
                 "count": MAX_CALLS, "seed": workload.SEED, "deadline": opts.timeout,
                 "retry_after": opts.retry_after_ms / 1000, "give_up": opts.give_up_s}  # fmt: skip
        outcomes: list[CallRecord] = []

        def storm_load() -> tuple[list[CallRecord], float]:
            attempts, cpu = _niced(loadgen.open_loop, flood, opts)
            outcomes.extend(attempts)
            return attempts, cpu

        storm = _phase(server, storm_load, opts.storm_texts, opts, opts.storm_duration)
        storm["offered_calls_per_s"] = rate
        storm["give_ups"] = give_ups(outcomes, saturation["calls_per_s"]["median"], opts.give_up_s)
        print(f"  retry storm: {storm['emb_per_s']['median']:.1f} emb/s, codes {storm['codes']}, "
              f"gave up {storm['give_ups']}")  # fmt: skip
    return {"multiple": opts.storm_multiple, "client_nice": opts.client_nice, "saturation": saturation,
            "storm": storm}  # fmt: skip


def spikes(opts: Options, texts: list[str]) -> dict[str, Any]:
    """Saturation with one text a call (``spike_concurrency`` closed-loop callers over
    ``spike_channels`` channels), then each of ``spike_multiples`` times its calls/s offered open
    loop (Poisson, no retries) over the same channels, as a connection pool or a mesh sidecar
    sends: goodput over saturation, the accepted calls' p95 against the drain budget and the
    refusals' p99, latency counted from each call's scheduled arrival; the real model,
    ``frontends=auto``, the clients ``client_nice`` below the server."""
    requests = encode(texts, 1)
    budget_ms = Settings.from_env({}).max_drain_ms
    with running(frontends_setting("auto"), _log("spikes"), module="kembed") as server:
        saturate = {"target": server.grpc_target, "requests": requests, "concurrency": opts.spike_concurrency,
                    "duration": opts.storm_duration, "count": MAX_CALLS, "deadline": opts.timeout,
                    "channels": opts.spike_channels}  # fmt: skip
        saturation = _phase(server, lambda: _niced(loadgen.closed_loop, saturate, opts), 1, opts, opts.storm_duration)
        print(f"  spikes: saturation {saturation['emb_per_s']['median']:.1f} emb/s")
        loads = []
        for multiple in opts.spike_multiples:
            time.sleep(Settings.from_env({}).latency_window_s)  # the server's latency window forgets the last load
            loads.append(_spike(server, requests, multiple, saturation["calls_per_s"]["median"], opts))
    return {"channels": opts.spike_channels, "drain_budget_ms": budget_ms, "client_nice": opts.client_nice,
            "saturation": saturation, "loads": loads}  # fmt: skip


def _spike(server: Server, requests: list[bytes], multiple: float, saturation_calls: float, opts: Options
           ) -> dict[str, Any]:  # fmt: skip
    """One open-loop load at ``multiple`` times saturation's calls/s, with the refusals the server paced."""
    rate = multiple * saturation_calls
    spike = {"target": server.grpc_target, "requests": requests, "rate": rate, "duration": opts.storm_duration,
             "count": MAX_CALLS, "seed": workload.SEED, "deadline": opts.timeout,
             "channels": opts.spike_channels}  # fmt: skip
    before = server.metrics()
    load = _phase(server, lambda: _niced(loadgen.open_loop, spike, opts), 1, opts, opts.storm_duration)
    load["refusals_paced"] = metric_delta(before, server.metrics(), Metric.REFUSALS_PACED + "_total")
    load["offered_x"], load["offered_calls_per_s"] = multiple, rate
    accepted, refused = load["latency_ms"]["p95"], load["rejection_latency_ms"]["p99"]
    print(f"  spikes: {multiple:g}x: {load['emb_per_s']['median']:.1f} emb/s, accepted p95 {accepted:.0f} ms, "
          f"refusals p99 {refused:.0f} ms")  # fmt: skip
    return load


# The short-deadline shape: real callers of 4 texts of about 40 words with 10 s deadlines; after a
# lead, careless callers of 1 text with 30 ms deadlines on a connection of their own.
DEADLINE_CALLERS, DEADLINE_TEXTS, DEADLINE_S = 24, 4, 10.0
SHORT_CALLERS, SHORT_DEADLINE_S, SHORT_LEAD_S = 48, 0.03, 12.0


async def deadline_mix(
    target: str, requests: list[bytes], short_requests: list[bytes], duration: float
) -> tuple[list[CallRecord], list[CallRecord]]:
    """The real callers for ``SHORT_LEAD_S + duration`` s; the short-deadline ones join after the lead."""
    real = asyncio.create_task(loadgen.closed_loop(
        target, requests, DEADLINE_CALLERS, SHORT_LEAD_S + duration, MAX_CALLS, DEADLINE_S))  # fmt: skip
    await asyncio.sleep(SHORT_LEAD_S)
    short = await loadgen.closed_loop(target, short_requests, SHORT_CALLERS, duration, MAX_CALLS, SHORT_DEADLINE_S)
    return await real, short


def short_deadlines(opts: Options, texts: list[str]) -> dict[str, Any]:
    """What the exported P95 (the autoscaler's metric) says while careless callers with 30 ms
    deadlines join real ones, against the real callers' own p95 over the same seconds: scraped
    every second after the latency window has filled with the mixed load."""
    requests, short = encode(texts, DEADLINE_TEXTS), encode(texts, 1)
    with running(frontends_setting("auto"), _log("deadlines"), module="kembed") as server:
        window_s = Settings.from_env({}).latency_window_s
        exported: list[float] = []
        stop = threading.Event()

        def scrape() -> None:
            stop.wait(SHORT_LEAD_S + window_s)
            while not stop.wait(1.0):
                exported.append(metric_sum(server.metrics(), Metric.LATENCY_P95_SECONDS))

        scraper = threading.Thread(target=scrape)
        scraper.start()
        try:
            job = {"target": server.grpc_target, "requests": requests, "short_requests": short,
                   "duration": opts.storm_duration}  # fmt: skip
            results, _ = loadgen.in_processes(deadline_mix, [job], nice=opts.client_nice)
            real, careless = results[0]
        finally:
            stop.set()
            scraper.join()
    since = SHORT_LEAD_S + window_s  # on the real callers' clock: the window holds the mixed load only
    served = [o.latency for o in real if o.code == OK and o.done >= since]
    p95_ms = latency_summary(served)["p95"]
    return {
        "exported_p95_ms": Spread.of([x * 1000 for x in exported]).to_dict(),
        "served_p95_ms": p95_ms,
        "served_before_ms": latency_summary([o.latency for o in real if o.code == OK and o.done < SHORT_LEAD_S]),
        "real_codes": dict(Counter(o.code for o in real)),
        "careless_codes": dict(Counter(o.code for o in careless)),
        "callers": {
            "real": DEADLINE_CALLERS,
            "texts": DEADLINE_TEXTS,
            "deadline_s": DEADLINE_S,
            "careless": SHORT_CALLERS,
            "careless_deadline_s": SHORT_DEADLINE_S,
        },
    }


def give_ups(attempts: Sequence[CallRecord], capacity_calls_per_s: float, give_up_s: float) -> dict[str, Any]:
    """Calls whose last attempt was refused, against the fewest that must give up: whatever a
    server serving ``capacity_calls_per_s`` cannot answer before the last of them gives up."""
    first: dict[int, CallRecord] = {}
    last: dict[int, CallRecord] = {}
    for outcome in sorted(attempts, key=lambda o: o.sent):
        first.setdefault(outcome.item, outcome)
        last[outcome.item] = outcome
    calls = len(last)
    arrivals = [o.scheduled for o in first.values()]
    window = (max(arrivals) - min(arrivals) + give_up_s) if arrivals else 0.0
    return {
        "calls": calls,
        "gave_up": sum(o.code in loadgen.REJECTED for o in last.values()),
        "fewest_possible": max(0, math.ceil(calls - capacity_calls_per_s * window)),
    }


def _niced(job: Callable[..., Coroutine[Any, Any, list[CallRecord]]], kwargs: dict[str, Any], opts: Options
           ) -> tuple[list[CallRecord], float]:  # fmt: skip
    """One load in a client process of its own, ``client_nice`` below the server."""
    parts, cpu = loadgen.in_processes(job, [kwargs], nice=opts.client_nice)
    return parts[0], cpu


def serve(opts: Options, texts: list[str]) -> dict[str, Any]:
    """The real model, ``frontends=auto``, one server for every load: the closed loop at each of
    ``serve_texts`` texts a call, with the server's counters and GPU busy over each load."""
    settings = {**frontends_setting("auto"), **dict(kv.split("=", 1) for kv in opts.serve_env)}
    window_s = Settings.from_env({env_name(k): v for k, v in settings.items()}).latency_window_s
    ceiling = ceiling_reference(opts.serve_ceiling)
    loads = []
    with running(settings, _log("serve"), module="kembed", start_timeout=opts.serve_start_timeout) as server:
        info = server.info()
        print(f"  serve: {info.get('modelId')} on {info.get('device')} ({info.get('dtype')}), {settings}")
        for i, n in enumerate(opts.serve_texts):
            if i:
                time.sleep(window_s)  # the server's latency window forgets the last load
            before = server.metrics()
            with machine.gpu_busy() as busy:
                figures = _closed_loop(server, encode(texts, n), opts, n)
                ended = time.monotonic()
            # GPU busy over the load's last (duration - warmup) s: client start-up and warm-up left out.
            steady = machine.busy_summary(busy, ended - (opts.duration - opts.warmup), ended)
            figures.update(texts_per_call=n, gpu_busy_pct=steady, gpu_busy_pct_whole_load=machine.busy_summary(busy))
            figures.update(_counters(before, server.metrics(), figures["span_s"]))
            loads.append(figures)
            print(f"  serve, {n} text(s) a call: {figures['emb_per_s']['median']:.0f} emb/s, "
                  f"p95 {figures['latency_ms']['p95']:.0f} ms, GPU busy {figures['gpu_busy_pct']['mean']:.0f}%, "
                  f"codes {figures['codes']}")  # fmt: skip
        profile = None
        if opts.py_spy_seconds > 0:
            time.sleep(window_s)
            profile = _profiled(server, encode(texts, 1), opts)
    return {"settings": settings, "info": info, "ceiling": ceiling, "loads": loads, "py_spy": profile}


def _counters(before: Samples, after: Samples, span_s: float) -> dict[str, Any]:
    """From the server's own counters over a load: padding, and the worker's busy share, padded
    tokens per compute-second and rows per batch."""
    real, padding = server_tokens(before, after)
    return {"padding_ratio": padding_ratio(real, padding), "worker": worker_figures(before, after, span_s)}


def ceiling_reference(name: str) -> dict[str, Any] | None:
    """The in-process ceiling the serve loads are judged against, from ``bench/results/<name>.json``:
    its ``sorted`` batching, or ``bucketed`` when compiled, with when and on what it ran."""
    if not name:
        return None
    result = machine.read_result(name)
    if result is None:
        print(f"  serve: no {RESULTS_DIR / name}.json; the loads are not judged against a ceiling")
        return None
    batching = "sorted" if "sorted" in result else "bucketed"
    ran = result["machine"]
    return {"name": name, "batching": batching, "compiled": bool(result.get("compiled")),
            "emb_per_s": result[batching]["emb_per_s"], "time_utc": ran["time_utc"], "gpu": ran["gpu"],
            "torch": ran["torch"]}  # fmt: skip


def _profiled(server: Server, requests: list[bytes], opts: Options) -> dict[str, Any]:
    """One more 1-text load, not judged, with ``py-spy record`` (raw collapsed stacks, per thread,
    non-blocking) on each server process for ``py_spy_seconds``, started as the clients start."""
    exe = shutil.which("py-spy")
    if exe is None:
        print("  serve: no py-spy on PATH; not profiled")
        return {"error": "no py-spy on PATH"}
    seconds = str(max(1, round(opts.py_spy_seconds)))
    spies = []
    for pid in process_tree(server.pid):
        out = RESULTS_DIR / f"pyspy_{pid}.txt"
        argv = [exe, "record", "--pid", str(pid), "--duration", seconds, "--threads", "--nonblocking",
                "--format", "raw", "--output", str(out)]  # fmt: skip
        spies.append((pid, out, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    figures = _closed_loop(server, requests, opts)
    processes = []
    for pid, out, spy in spies:
        try:
            _, err = spy.communicate(timeout=opts.py_spy_seconds + 30)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
        processes.append({"pid": pid, "cmdline": _cmdline(pid), "file": out.name if out.exists() else None,
                          "exit": spy.returncode, "stderr": err.decode(errors="replace")[-400:]})  # fmt: skip
    print(f"  serve, profiled: {sum(p['file'] is not None for p in processes)} of {len(processes)} processes recorded")
    return {"load": figures, "processes": processes}


def _cmdline(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")).strip()
    except OSError:
        return ""


def _calls(figures: dict[str, Any]) -> str:
    return f"{figures['calls_per_s']['median']:.0f}"


def run(opts: Options) -> dict[str, Any]:
    """Every part in ``opts.parts``, each server started and stopped in turn; writes ``hostpath.json``."""
    wl = workload.load()
    short = [t for t, n in zip(wl.texts, wl.tokens, strict=True) if n <= SHORT_TOKENS]
    about_60_words = [t for t, n in zip(wl.texts, wl.tokens, strict=True) if BURST_TOKENS[0] < n <= BURST_TOKENS[1]]
    result: dict[str, Any] = {"settings": asdict(opts), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"hostpath: {', '.join(opts.parts)}; load average {result['loadavg_at_start']}")
    if "host_path" in opts.parts:
        result["host_path"] = host_path(opts, short)
    if "rejection" in opts.parts:
        result["rejection"] = rejection(opts, about_60_words)
    if "rest" in opts.parts:
        result["rest"] = rest(opts, short)
    if "storm" in opts.parts:
        result["retry_storm"] = retry_storm(opts, wl.texts)
    if "spikes" in opts.parts:
        result["spikes"] = spikes(opts, wl.texts)
    if "deadlines" in opts.parts:
        result["short_deadlines"] = short_deadlines(opts, [t for t in wl.texts if 32 <= len(t.split()) <= 48])
    if "serve" in opts.parts:
        result["serve"] = serve(opts, wl.texts)
    machine.write_judged(opts.name, result, headline.hostpath_ratios(result), wl.describe())
    return result


def parse_options(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_options(argv))


if __name__ == "__main__":
    main()
