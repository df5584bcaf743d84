"""Part ``deadlines``: short-deadline callers beside a saturating load, and how many gave up."""

from __future__ import annotations

import asyncio
import math
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.serving.hostpath.measure import (
    DEADLINE_CALLERS,
    DEADLINE_S,
    DEADLINE_TEXTS,
    MAX_CALLS,
    SHORT_CALLERS,
    SHORT_DEADLINE_S,
    SHORT_LEAD_S,
    Options,
    encode,
    log_file,
    real_model,
)
from bench.tools import loadgen
from bench.tools.loadgen import OK, CallRecord
from bench.tools.report import (
    Spread,
    latency_summary,
    metric_sum,
)
from bench.tools.server import running
from kembed.config.settings import Settings
from kembed.contract import Metric


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
    with running(real_model(opts), log_file("deadlines"), module="kembed") as server:
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
