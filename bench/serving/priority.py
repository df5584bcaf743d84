"""Queries beside an ingest: the priority classes under load, ``python -m bench.serving.priority``.

One real server (``KEMBED_FRONTENDS=auto``, what a pod runs), five loads, the server's latency
window between them:

1. **Saturation**: the ingest alone, batch class: ``--concurrency`` closed-loop callers, each call
   ``--texts`` workload texts (``truncate=true``), respecting the pushback.
2. **Idle**: interactive calls alone, one short text each (the workload's texts of at most 16
   tokens: a search query), Poisson arrivals at ``--share`` times saturation's embeddings/s.
3. **Beside**: both at once, from one client process.
4. **One class**: the same, with the ingest sent interactive too: what a server with one queue
   does (kembed before the classes).
5. **Starved**: interactive calls saturating the server (``--starve-concurrency`` closed-loop
   callers, one short text each) beside one batch caller: how long batch work waits, which the
   batcher's floor bounds (docs/admission.md, "Priority classes").

A batch duration is the mean compute time of a batch during the load, from the server's own
``kembed_inference_seconds``. Targets, judged on the *beside* load: no interactive call rejected;
interactive p95 at most the idle p95 plus two batch durations (a batch already in the model cannot
be preempted, and the query's own may be one) and at most 0.35 of the batch class's p95; goodput
(interactive plus batch embeddings/s) at least 0.9 of saturation. Writes
``bench/results/<--name>.json``; the server's log goes to ``bench/results/priority.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench import RESULTS_DIR, headline
from bench.tools import loadgen, machine, workload
from bench.tools.loadgen import OK, CallRecord
from bench.tools.report import Samples, Spread, latency_summary, metric_delta, window_rates
from bench.tools.server import Server, running
from bench.tools.standin import model_settings
from kembed.config.settings import Settings
from kembed.contract import PRIORITY_LABEL, Metric
from kembed.policy.priority import Priority
from kembed.v1 import embedder_pb2

SHORT_TOKENS = 16  # a query: the workload's shortest class
MAX_CALLS = 1_000_000  # loads end on time; this only bounds a runaway
PROTO = {Priority.INTERACTIVE: embedder_pb2.PRIORITY_INTERACTIVE, Priority.BATCH: embedder_pb2.PRIORITY_BATCH}


@dataclass(frozen=True)
class Options:
    concurrency: int  # closed-loop ingest callers
    texts: int  # workload texts per ingest call
    share: float  # interactive calls/s, as a share of saturation's embeddings/s
    starve_concurrency: int  # closed-loop interactive callers that saturate the server (load 5)
    duration: float  # seconds per load
    warmup: float  # seconds at the start of a load left out of the rates
    windows: int
    timeout: float  # client deadline per call
    name: str
    model: str = "bundled"  # bundled, standin (bench.tools.standin) or a model folder


def requests(texts: Sequence[str], per_call: int, priority: Priority) -> list[bytes]:
    """Calls of ``per_call`` consecutive texts (``truncate=true``) of a class, the texts reused in turn."""
    cycle = itertools.cycle(texts)
    return [
        embedder_pb2.EmbedRequest(
            texts=list(itertools.islice(cycle, per_call)), truncate=True, priority=PROTO[priority]
        ).SerializeToString()
        for _ in range(max(1, len(texts) // per_call))
    ]


async def together(loads: list[tuple[str, dict[str, Any]]]) -> list[list[CallRecord]]:
    """Several loads at once in one client process: each a ``bench.tools.loadgen`` function's name and its
    arguments. Their clocks start within a loop turn of one another."""
    return list(await asyncio.gather(*(getattr(loadgen, job)(**kwargs) for job, kwargs in loads)))


def emb_per_s(sides: Sequence[tuple[Sequence[CallRecord], int]], opts: Options) -> dict[str, float]:
    """Embeddings/s of the successful calls of every side together (each with its texts per call):
    median and range over the windows after the warm-up."""
    done = [(o.done, float(n)) for outcomes, n in sides for o in outcomes if o.code == OK]
    times, weights = [t for t, _ in done], [w for _, w in done]
    return Spread.of(window_rates(times, weights, opts.warmup, opts.duration, opts.windows)).to_dict()


def side(outcomes: Sequence[CallRecord], texts_per_call: int, opts: Options) -> dict[str, Any]:
    """One side of a load: its embeddings/s, the latency of its successful calls, every status code counted."""
    return {
        "calls": len(outcomes),
        "codes": dict(Counter(o.code for o in outcomes)),
        "emb_per_s": emb_per_s([(outcomes, texts_per_call)], opts),
        "latency_ms": latency_summary([o.latency for o in outcomes if o.code == OK]),
    }


def server_figures(before: Samples, after: Samples) -> dict[str, Any]:
    """From the server's counters over a load: its batches' mean compute time, and the rejections
    of each class by reason."""
    compute_s = metric_delta(before, after, Metric.INFERENCE_SECONDS + "_sum")
    batches = metric_delta(before, after, Metric.INFERENCE_SECONDS + "_count")
    rejected = Metric.REJECTED + "_total"
    reasons = {dict(labels)["reason"] for name, labels in after if name == rejected}
    return {
        "batch_seconds": compute_s / batches if batches else math.nan,
        "batches": batches,
        "rejections": {
            p.label: {r: metric_delta(before, after, rejected, reason=r, **{PRIORITY_LABEL: p.label}) for r in reasons}
            for p in Priority
        },
    }


class Loads:
    """The loads against one server, each measured with the server's counters around it."""

    def __init__(self, server: Server, opts: Options, texts: list[str], queries: list[str]) -> None:
        self._server = server
        self._opts = opts
        self._ingest = requests(texts, opts.texts, Priority.BATCH)
        self._ingest_interactive = requests(texts, opts.texts, Priority.INTERACTIVE)
        self._queries = requests(queries, 1, Priority.INTERACTIVE)
        self._ingest_trickle = self._ingest[:1]

    def closed(self, calls: list[bytes], concurrency: int) -> tuple[str, dict[str, Any]]:
        o = self._opts
        return "closed_loop", {"target": self._server.grpc_target, "requests": calls, "concurrency": concurrency,
                               "duration": o.duration, "count": MAX_CALLS, "deadline": o.timeout}  # fmt: skip

    def poisson(self, calls: list[bytes], rate: float) -> tuple[str, dict[str, Any]]:
        o = self._opts
        return "open_loop", {"target": self._server.grpc_target, "requests": calls, "rate": rate,
                             "duration": o.duration, "count": MAX_CALLS, "seed": workload.SEED,
                             "deadline": o.timeout}  # fmt: skip

    def measure(self, **sides: tuple[tuple[str, dict[str, Any]], int]) -> dict[str, Any]:
        """The named sides at once (each a load and its texts per call): each side's figures, every
        side's embeddings/s together, and the server's figures."""
        before = self._server.metrics()
        (outcomes,), _ = loadgen.in_processes(together, [{"loads": [load for load, _ in sides.values()]}])
        per_call = [n for _, n in sides.values()]
        figures = {name: side(got, n, self._opts) for name, got, n in zip(sides, outcomes, per_call, strict=True)}
        total = emb_per_s(list(zip(outcomes, per_call, strict=True)), self._opts)
        return {**figures, "total_emb_per_s": total, "server": server_figures(before, self._server.metrics())}

    def ingest(self) -> tuple[tuple[str, dict[str, Any]], int]:
        """The ingest side: closed-loop batch calls of ``--texts`` texts."""
        return self.closed(self._ingest, self._opts.concurrency), self._opts.texts

    def queries(self, rate: float) -> tuple[tuple[str, dict[str, Any]], int]:
        """The queries side: one short text a call, Poisson arrivals at ``rate``/s."""
        return self.poisson(self._queries, rate), 1

    def saturation(self) -> tuple[dict[str, Any], float]:
        """The ingest alone, measured, and the query rate it sets (``--share`` of its embeddings/s)."""
        saturation = self.measure(batch=self.ingest())
        rate = self._opts.share * saturation["batch"]["emb_per_s"]["median"]
        if not rate > 0:
            raise RuntimeError(f"no ingest call succeeded at saturation ({saturation['batch']['codes']})")
        print(f"  saturation {saturation['batch']['emb_per_s']['median']:.1f} emb/s; queries at {rate:.2f}/s")
        return saturation, rate

    def run(self) -> dict[str, Any]:
        o = self._opts
        saturation, rate = self.saturation()
        loads: dict[str, Any] = {"saturation": saturation, "query_rate": rate}
        plan = {
            "idle": {"interactive": self.queries(rate)},
            "beside": {"batch": self.ingest(), "interactive": self.queries(rate)},
            "one_class": {
                "batch": (self.closed(self._ingest_interactive, o.concurrency), o.texts),
                "interactive": self.queries(rate),
            },
            "starved": {
                "batch": (self.closed(self._ingest_trickle, 1), o.texts),
                "interactive": (self.closed(self._queries, o.starve_concurrency), 1),
            },
        }
        for name, sides in plan.items():
            loads[name] = self.after_pause(name, **sides)
        return loads

    def after_pause(self, name: str, **sides: tuple[tuple[str, dict[str, Any]], int]) -> dict[str, Any]:
        """``measure``, once the server's latency windows have forgotten the last load; printed."""
        time.sleep(Settings.from_env({}).latency_window_s)
        figures = self.measure(**sides)
        print(f"  {name}: " + ", ".join(brief(k, figures[k]) for k in sides))
        return figures


def brief(name: str, figures: dict[str, Any]) -> str:
    return (f"{name} {figures['emb_per_s']['median']:.1f} emb/s, p95 {figures['latency_ms']['p95']:.0f} ms, "
            f"codes {figures['codes']}")  # fmt: skip


def short_texts(wl: workload.Workload) -> list[str]:
    """The queries' texts: the workload's of at most ``SHORT_TOKENS`` tokens."""
    return [t for t, n in zip(wl.texts, wl.tokens, strict=True) if n <= SHORT_TOKENS]


def run(opts: Options) -> dict[str, Any]:
    wl = workload.load()
    result: dict[str, Any] = {"settings": asdict(opts), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"priority: load average {result['loadavg_at_start']}")
    settings = {"frontends": "auto", **model_settings(opts.model)}
    with running(settings, RESULTS_DIR / "priority.log", module="kembed") as server:
        result["loads"] = Loads(server, opts, wl.texts, short_texts(wl)).run()
    result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    machine.write_judged(opts.name, result, headline.priority_ratios(result), wl.describe())
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=24, help="closed-loop ingest callers")
    parser.add_argument("--texts", type=int, default=16, help="workload texts per ingest call")
    parser.add_argument("--share", type=float, default=0.1, help="query calls/s over saturation's emb/s")
    parser.add_argument("--starve-concurrency", type=int, default=64, help="closed-loop query callers (starved)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per load")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds at the start of a load not counted")
    parser.add_argument("--windows", type=int, default=4, help="time windows per load, for the spread")
    parser.add_argument("--timeout", type=float, default=30.0, help="client deadline per call, seconds")
    parser.add_argument("--name", default="priority", help="write bench/results/NAME.json")
    parser.add_argument("--model", default="bundled", help="bundled, standin (fast compute on any CPU) or a folder")
    return run(Options(**vars(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
