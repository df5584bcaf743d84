"""The autoscaler's metric, measured: ``python -m bench.serving.demand`` (issue 44).

1. **Gauge** (part ``gauge``; one server, the real model, default settings). Its saturation: closed
   loop, ``--concurrency`` callers of one short text a call (at most 16 tokens: the call the
   service rate is dearest in, so a call's padded tokens are alike and calls/s is a fair unit of
   offered work). Then open-loop Poisson calls at each of ``--multiples`` times its calls/s, and
   ``--retry-multiple`` times with gRPC's own retry policy on RESOURCE_EXHAUSTED (the channel's
   service config: its attempts carry ``grpc-previous-rpc-attempts`` and follow the pushback), each
   ``--phase-s`` long; ``kembed_demand_ratio`` is scraped every second over each phase's last
   ``--sample-s`` (its 15 s EWMA has settled by then). Targets: 0.75-1.3 at 1x; each other
   multiple within 25% of proportional to the 1x reading; the retried multiple 2.25-3.9x the 1x reading.
   ``--texts N`` sends N short texts a call instead (``demand_gauge_texts<N>.json``): at one text a
   call on two cores the front end's per-call cost (issue 46), not the engine, caps what 4x can
   even be read and refused at.
2. **A pod started under load** (part ``new_pod``). ``--concurrency`` closed-loop callers of one
   short text wait while a server starts (``KEMBED_COMPILE_CACHE_DIR`` empty, *cold*, then with
   what the cold start left, *warm*); from the instant its ``/readyz`` answers they send, for
   ``--new-pod-s``. Refusals in the first 60 s after ready; emb/s in its first 30 s and in the
   last 30 s (settled); the forward ``auto`` chose (``/health`` at the end). Targets: no refusal in
   the first 60 s; the first 30 s at least 0.8 of settled.

The clients run ``--client-nice`` below the server (in production they are other machines).
Writes ``bench/results/demand_gauge.json`` and ``bench/results/demand_new_pod.json``.

    python -m bench.serving.demand --parts gauge,new_pod
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import RESULTS_DIR
from bench.serving import startup
from bench.serving.hostpath import measure
from bench.tools import loadgen, machine, workload
from bench.tools.loadgen import OK, CallRecord
from bench.tools.report import metric_sum
from bench.tools.server import HOST, Server, is_ready, running
from kembed.contract import GRPC_SERVICE, Metric
from kembed.plumbing import listen

PARTS = ("gauge", "new_pod")
# gRPC's own retry policy (gRFC A6), as a client's channel sets it: a refused call is sent again
# after its pushback (grpc-retry-pushback-ms), up to three attempts in all.
RETRY_POLICY = {
    "methodConfig": [{
        "name": [{"service": GRPC_SERVICE}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "2s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]},
    }]
}  # fmt: skip
RETRY_OPTIONS = (("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(RETRY_POLICY)))
FIRST_REFUSALS_S, FIRST_RATE_S = 60.0, 30.0  # the new pod's windows after ready


@dataclasses.dataclass(frozen=True)
class Options:
    parts: tuple[str, ...]
    concurrency: int
    saturation_s: float
    multiples: tuple[float, ...]
    retry_multiple: float
    phase_s: float
    sample_s: float
    new_pod_s: float
    client_nice: int
    timeout: float
    texts: int


def _hostpath_options(opts: Options, duration: float) -> measure.Options:
    """hostpath's options for its phase helpers: rates over the whole phase, in 3 windows."""
    base = measure.parse_options([])
    return dataclasses.replace(base, warmup=0.0, windows=3, storm_duration=duration, client_nice=opts.client_nice,
                               timeout=opts.timeout)  # fmt: skip


def short_requests(per_call: int = 1) -> list[bytes]:
    wl = workload.load()
    short = [t for t, n in zip(wl.texts, wl.tokens, strict=True) if n <= measure.SHORT_TOKENS]
    return measure.encode(short, per_call)


class GaugeSampler:
    """``kembed_demand_ratio`` and its denominator, the service rate (padded tokens per second of
    worker compute), scraped once a second on a thread, with the time of each scrape."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._stop = threading.Event()
        self.samples: list[tuple[float, float, float, float]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            scraped = self._server.metrics()
            names = (Metric.DEMAND_RATIO, Metric.SERVICE_RATE, Metric.CAPACITY)
            ratio, rate, capacity = (metric_sum(scraped, name) for name in names)
            self.samples.append((time.monotonic(), ratio, rate, capacity))

    def __enter__(self) -> GaugeSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> dict[str, Any]:
        """The ratio's mean and samples, and the service rate's and capacity's means, scraped in [start, end]."""
        inside = [sample for sample in self.samples if start <= sample[0] <= end]
        return {
            "mean": mean([ratio for _, ratio, _, _ in inside]),
            "samples": [ratio for _, ratio, _, _ in inside],
            "service_rate_tokens_per_s": mean([rate for _, _, rate, _ in inside]),
            "capacity_tokens_per_s": mean([capacity for _, _, _, capacity in inside]),
        }


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _open_phase(server: Server, sampler: GaugeSampler, rate: float, opts: Options, retried: bool) -> dict[str, Any]:
    """One open-loop phase at ``rate`` calls/s; the gauge over its last ``sample_s``."""
    load = {"target": server.grpc_target, "requests": short_requests(opts.texts), "rate": rate,
            "duration": opts.phase_s, "count": measure.MAX_CALLS, "seed": workload.SEED, "deadline": opts.timeout,
            "options": RETRY_OPTIONS if retried else ()}  # fmt: skip
    hp = _hostpath_options(opts, opts.phase_s)
    started = time.monotonic()
    figures = measure.phase_figures(server, lambda: measure.niced(loadgen.open_loop, load, hp), 1, hp, opts.phase_s)
    # The client process starts (spawn, imports) before its clock: the phase ends span_s after that.
    ended = time.monotonic()
    figures["offered_calls_per_s"] = rate
    figures["gauge"] = {**sampler.between(ended - opts.sample_s, ended), "phase_wall_s": ended - started}
    return figures


def gauge(opts: Options) -> dict[str, Any]:
    hp = _hostpath_options(opts, opts.saturation_s)
    with running({}, RESULTS_DIR / "demand_gauge.log") as server:
        saturate = {"target": server.grpc_target, "requests": short_requests(opts.texts),
                    "concurrency": opts.concurrency, "duration": opts.saturation_s, "count": measure.MAX_CALLS,
                    "deadline": opts.timeout}  # fmt: skip
        saturation = measure.phase_figures(server, lambda: measure.niced(loadgen.closed_loop, saturate, hp), 1, hp,
                                     opts.saturation_s)  # fmt: skip
        calls_per_s = saturation["calls_per_s"]["median"]
        saturation["service_rate_tokens_per_s"] = metric_sum(server.metrics(), Metric.SERVICE_RATE)
        print(f"demand gauge: saturation {calls_per_s:.1f} calls/s, codes {saturation['codes']}", flush=True)
        phases = []
        with GaugeSampler(server) as sampler:
            runs = [(m, False) for m in opts.multiples] + [(opts.retry_multiple, True)]
            for multiple, retried in runs:
                phase = _open_phase(server, sampler, multiple * calls_per_s, opts, retried)
                phase["offered_x"], phase["grpc_retry_policy"] = multiple, retried
                phases.append(phase)
                print(f"demand gauge: {multiple:g}x{' (gRPC retries)' if retried else ''}: gauge "
                      f"{phase['gauge']['mean']:.2f}, codes {phase['codes']}", flush=True)  # fmt: skip
        served = server.served()
    return {"saturation": saturation, "phases": phases, "verdict": gauge_verdict(phases), "served": served}


def gauge_verdict(phases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each phase's reading over the 1x reading, against proportional, and the targets."""
    one = next(p["gauge"]["mean"] for p in phases if p["offered_x"] == 1.0 and not p["grpc_retry_policy"])
    rows = []
    for p in phases:
        over_one = p["gauge"]["mean"] / one if one else float("nan")
        if p["grpc_retry_policy"]:
            met = 0.75 * p["offered_x"] <= over_one <= 1.3 * p["offered_x"]
        elif p["offered_x"] == 1.0:
            met = 0.75 <= one <= 1.3
        else:
            met = abs(over_one / p["offered_x"] - 1) <= 0.25
        rows.append({"offered_x": p["offered_x"], "grpc_retry_policy": p["grpc_retry_policy"],
                     "gauge": p["gauge"]["mean"], "over_1x": over_one, "met": met})  # fmt: skip
    return {"one_x": one, "rows": rows, "all_met": all(r["met"] for r in rows)}


def ready_ports(log: Path) -> dict[str, int]:
    """The ports of the server writing ``log``, once its ``/readyz`` answers (polled every 50 ms)."""
    while (ports := listen.listening_ports(log.read_text(errors="replace")) if log.exists() else None) is None:
        time.sleep(0.05)
    while not is_ready(f"http://{HOST}:{ports['http']}"):
        time.sleep(0.05)
    return ports


async def after_ready(log: str, **closed_loop: Any) -> tuple[list[CallRecord], float]:
    """In a client process started before the server: wait for the server writing ``log`` to be
    ready, then run ``loadgen.closed_loop`` at once (its clock starts once connected, a few
    milliseconds after ready). Also the seconds the load overran its duration."""
    ports = await asyncio.to_thread(ready_ports, Path(log))
    ready = time.perf_counter()
    outcomes = await loadgen.closed_loop(target=f"{HOST}:{ports['grpc']}", **closed_loop)
    return outcomes, time.perf_counter() - ready - closed_loop["duration"]


def new_pod_start(opts: Options, cache: str, log: Path) -> dict[str, Any]:
    """One server started with ``cache`` while the callers wait; their figures from ready on."""
    log.unlink(missing_ok=True)
    job = {"log": str(log), "requests": short_requests(), "concurrency": opts.concurrency,
           "duration": opts.new_pod_s, "count": measure.MAX_CALLS, "deadline": opts.timeout}  # fmt: skip
    done: list[tuple[list[CallRecord], float]] = []
    clients = threading.Thread(
        target=lambda: done.extend(loadgen.in_processes(after_ready, [job], nice=opts.client_nice)[0])
    )
    clients.start()
    started = time.monotonic()
    with running({"compile_cache_dir": cache}, log, start_timeout=600.0, settled=False) as server:
        ready_s = time.monotonic() - started
        clients.join()
        health = server.health()
    outcomes, overrun_s = done[0]
    return {"ready_s": ready_s, "overrun_s": overrun_s, **new_pod_figures(outcomes, opts.new_pod_s),
            **{key: health.get(key) for key in ("forward", "forward_reason", "dtype")},
            **startup.logged_seconds(log.read_text(errors="replace"))}  # fmt: skip


def new_pod_figures(outcomes: Sequence[CallRecord], duration: float) -> dict[str, Any]:
    """Refusals in the first 60 s after ready, emb/s (one text a call) in its first 30 s and in the
    last 30 s of the load, and their ratio against the targets."""
    first = [o for o in outcomes if o.sent < FIRST_REFUSALS_S]
    ok = [o.done for o in outcomes if o.code == OK]
    early = sum(t < FIRST_RATE_S for t in ok) / FIRST_RATE_S
    settled = sum(duration - FIRST_RATE_S <= t < duration for t in ok) / FIRST_RATE_S
    refusals = sum(o.code != OK for o in first)
    ratio = early / settled if settled else float("nan")
    return {"codes": dict(Counter(o.code for o in outcomes)), "codes_first_60_s": dict(Counter(o.code for o in first)),
            "refusals_first_60_s": refusals, "emb_per_s_first_30_s": early, "emb_per_s_settled": settled,
            "first_over_settled": ratio, "met": {"no_refusals": refusals == 0, "first_30_s": ratio >= 0.8}}  # fmt: skip


def new_pod(opts: Options) -> dict[str, Any]:
    starts = {}
    with tempfile.TemporaryDirectory(prefix="kembed-compile-cache-") as cache:
        for name in startup.STARTS:  # cold, then warm from what cold left
            starts[name] = figures = new_pod_start(opts, cache, RESULTS_DIR / f"demand_new_pod_{name}.log")
            print(f"demand new pod, {name}: ready in {figures['ready_s']:.1f} s, {figures['codes_first_60_s']} "
                  f"in 60 s, {figures['emb_per_s_first_30_s']:.1f} emb/s first 30 s, "
                  f"{figures['emb_per_s_settled']:.1f} settled, {figures['forward']} ({figures['forward_reason']})",
                  flush=True)  # fmt: skip
    return {"starts": starts}


def parse_options(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop callers (saturation, new pod)")
    parser.add_argument("--saturation-s", type=float, default=20.0, help="seconds of the saturation")
    parser.add_argument("--multiples", default="0.5,1,2,4", help="open-loop calls/s, times saturation's")
    parser.add_argument("--retry-multiple", type=float, default=3.0, help="the same, with gRPC's retry policy")
    parser.add_argument("--phase-s", type=float, default=45.0, help="seconds per open-loop phase")
    parser.add_argument("--sample-s", type=float, default=12.0, help="gauge scraped over a phase's last seconds")
    parser.add_argument("--new-pod-s", type=float, default=90.0, help="seconds of load after the new pod is ready")
    parser.add_argument("--client-nice", type=int, default=19, help="clients' niceness, added to ours")
    parser.add_argument("--timeout", type=float, default=30.0, help="client deadline per call, seconds")
    parser.add_argument("--texts", type=int, default=1, help="short texts a call in the gauge's load")
    args = parser.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    if "1" not in args.multiples.split(","):
        parser.error("--multiples: must hold 1 (the reading the others are judged against)")
    if args.new_pod_s < FIRST_REFUSALS_S + FIRST_RATE_S:
        parser.error(f"--new-pod-s: at least {FIRST_REFUSALS_S + FIRST_RATE_S:g} (60 s, then 30 s settled)")
    multiples = tuple(float(x) for x in args.multiples.split(",") if x)
    return Options(**{**vars(args), "parts": parts, "multiples": multiples})


def main(argv: Sequence[str] | None = None) -> None:
    opts = parse_options(argv)
    loadavg = [round(x, 2) for x in os.getloadavg()]
    print(f"demand: {', '.join(opts.parts)}; load average {loadavg}", flush=True)
    settings = {**dataclasses.asdict(opts), "loadavg_at_start": loadavg}
    if "gauge" in opts.parts:
        name = "demand_gauge" if opts.texts == 1 else f"demand_gauge_texts{opts.texts}"
        machine.write_result(name, {"settings": settings, **gauge(opts)})
    if "new_pod" in opts.parts:
        machine.write_result("demand_new_pod", {"settings": settings, **new_pod(opts)})


if __name__ == "__main__":
    main()
