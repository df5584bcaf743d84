"""Admission one client cannot game, measured: ``python -m bench.serving.fairness``.

Each part (``--parts``, each runnable alone) starts its own real server (``KEMBED_FRONTENDS=auto``,
what a pod runs) and first measures one-text queries alone (Poisson arrivals at ``--query-rate``
for ``--duration`` s, a gRPC client process): the idle p95. Then:

1. **lockout**: one maximal request sent as LangChain's ``OpenAIEmbeddings`` sends an ingest, over
   the OpenAI API with no priority and no deadline: ``--lockout-texts`` passages of about 250
   words (``truncate``: 256 tokens each; 1,024 of them are 262,144 padded tokens, the queue cap),
   and the same queries from another client while it is computed. A batch duration is the mean
   compute time of a batch during the load (the server's ``kembed_inference_seconds``). Targets: no
   query refused, and their p95 at most the idle p95 plus two batch durations (a batch of the
   ingest in the worker is not preempted, and the query's own may be one). Informative: whether
   the ingest was answered, and when.
2. **poison**: the same queries beside ``--attackers`` clients sending maximal requests (1,024 x 256
   pre-tokenized ids, sent interactive, as in issue 25) back to back, ignoring their pushback. The
   exported P95 (``kembed_request_latency_p95_seconds``, the autoscaler's metric) and ``/health``
   are read every ``--sample-s``. Target: the largest exported P95 seen at most 1.5x the served
   queries' own p95 (the client's). Informative: the attackers' calls by code, the statuses
   ``/health`` reported.

Writes ``bench/results/<--name>.json`` with the judged ratios; the server logs go to
``bench/results/fairness_<part>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench import RESULTS_DIR, headline
from bench.serving.priority import SHORT_TOKENS, requests, server_figures, together
from bench.tools import loadgen, machine, workload
from bench.tools.loadgen import OK, CallRecord
from bench.tools.report import latency_summary, metric_delta, metric_sum
from bench.tools.server import Server, running
from kembed.config.settings import Settings
from kembed.contract import HEALTH_PATH, Metric
from kembed.policy.priority import Priority
from kembed.v1 import embedder_pb2

PARTS = ("lockout", "poison")
PASSAGE_WORDS = 250
MAX_CALLS = 1_000_000  # loads end on time; this only bounds a runaway
MAXIMAL_ITEMS, MAXIMAL_TOKENS = 1024, 256
SERVER = {"frontends": "auto"}


@dataclass(frozen=True)
class Options:
    parts: tuple[str, ...]
    query_rate: float  # one-text queries a second, Poisson
    duration: float  # seconds per load
    lockout_texts: int  # passages in the maximal ingest request (part lockout)
    attackers: int  # clients sending maximal requests back to back (part poison)
    sample_s: float  # how often the exported P95 and /health are read (part poison)
    timeout: float  # client deadline per query
    name: str


def passages(texts: Sequence[str], count: int) -> list[str]:
    """``count`` passages of about PASSAGE_WORDS words, from the workload's texts in turn."""
    words = " ".join(texts).split()
    words *= count * PASSAGE_WORDS // len(words) + 1
    return [" ".join(words[i * PASSAGE_WORDS : (i + 1) * PASSAGE_WORDS]) for i in range(count)]


def maximal_request() -> bytes:
    """1,024 sequences of 256 in-vocabulary ids, pre-tokenized, with no priority (interactive)."""
    ids = np.full(MAXIMAL_TOKENS, 2088, dtype="<i4").tobytes() * MAXIMAL_ITEMS
    tokens = embedder_pb2.TokenIds(ids=ids, lengths=[MAXIMAL_TOKENS] * MAXIMAL_ITEMS)
    return embedder_pb2.EmbedRequest(tokens=tokens).SerializeToString()


def queries(server: Server, calls: list[bytes], opts: Options, seed: int = workload.SEED) -> tuple[str, dict[str, Any]]:
    return "open_loop", {"target": server.grpc_target, "requests": calls, "rate": opts.query_rate,
                         "duration": opts.duration, "count": MAX_CALLS, "seed": seed,
                         "deadline": opts.timeout}  # fmt: skip


def side(outcomes: Sequence[CallRecord]) -> dict[str, Any]:
    """Calls by code and the latency of the successful ones."""
    return {
        "calls": len(outcomes),
        "codes": dict(Counter(o.code for o in outcomes)),
        "latency_ms": latency_summary([o.latency for o in outcomes if o.code == OK]),
    }


def idle(server: Server, calls: list[bytes], opts: Options) -> dict[str, Any]:
    (outcomes,), _ = loadgen.in_processes(together, [{"loads": [queries(server, calls, opts)]}])
    return side(outcomes[0])


def lockout(opts: Options, texts: list[str], short: list[str]) -> dict[str, Any]:
    """Queries alone, then beside one maximal ingest sent as LangChain sends it."""
    calls = requests(short, 1, Priority.INTERACTIVE)
    body = json.dumps({"input": passages(texts, opts.lockout_texts), "truncate": True}).encode()
    with running(SERVER, RESULTS_DIR / "fairness_lockout.log", module="kembed") as server:
        alone = idle(server, calls, opts)
        time.sleep(Settings.from_env({}).latency_window_s)
        before = server.metrics()
        with _posted(server, body) as ingest, _sampled(server, opts.sample_s) as samples:
            (outcomes,), _ = loadgen.in_processes(together, [{"loads": [queries(server, calls, opts)]}])
            beside = side(outcomes[0])
            after = server.metrics()
        beside["server"] = server_figures(before, after)
        beside["batch_seconds"] = beside["server"]["batch_seconds"]
        beside["demoted"] = metric_delta(before, after, Metric.DEMOTED + "_total")
    print(f"  lockout: queries alone p95 {alone['latency_ms']['p95']:.0f} ms; beside the ingest p95 "
          f"{beside['latency_ms']['p95']:.0f} ms, codes {beside['codes']}, batch {beside['batch_seconds']:.3f} s, "
          f"server rejections {beside['server']['rejections']}; ingest {ingest}")  # fmt: skip
    return {"texts": opts.lockout_texts, "idle": alone, "beside": beside, "ingest": ingest, "health": samples}


@contextmanager
def _posted(server: Server, body: bytes) -> Iterator[dict[str, Any]]:
    """One POST /v1/embeddings in a thread, sent at once; its status and seconds once answered (the
    block waits for it on the way out)."""
    answer: dict[str, Any] = {}
    request = urllib.request.Request(server.rest_url + "/v1/embeddings", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip

    def send() -> None:
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=3600) as reply:
                answer["status"] = reply.status
        except urllib.error.HTTPError as error:
            answer["status"] = error.code
        answer["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield answer
    finally:
        thread.join()


def poison(opts: Options, short: list[str]) -> dict[str, Any]:
    """Queries alone, then beside clients sending maximal requests back to back; the exported P95
    and /health read throughout."""
    calls = requests(short, 1, Priority.INTERACTIVE)
    with running(SERVER, RESULTS_DIR / "fairness_poison.log", module="kembed") as server:
        alone = idle(server, calls, opts)
        time.sleep(Settings.from_env({}).latency_window_s)
        attack = ("closed_loop", {"target": server.grpc_target, "requests": [maximal_request()],
                                  "concurrency": opts.attackers, "duration": opts.duration, "count": MAX_CALLS,
                                  "deadline": opts.timeout, "pushback": False})  # fmt: skip
        before = server.metrics()
        with _sampled(server, opts.sample_s) as samples:
            loads = [queries(server, calls, opts), attack]
            (outcomes,), _ = loadgen.in_processes(together, [{"loads": loads}])
        after = server.metrics()
    served, attackers = side(outcomes[0]), side(outcomes[1])
    served["server"] = server_figures(before, after)
    exported = [sample["exported_p95_ms"] for sample in samples]
    print(f"  poison: queries alone p95 {alone['latency_ms']['p95']:.0f} ms; beside the attackers p95 "
          f"{served['latency_ms']['p95']:.0f} ms, codes {served['codes']}; exported P95 at most "
          f"{max(exported, default=0):.0f} ms; attackers' codes {attackers['codes']}")  # fmt: skip
    return {"attackers": opts.attackers, "idle": alone, "beside": served, "attack": attackers,
            "exported_p95_ms": exported, "health": dict(Counter(sample["status"] for sample in samples)),
            "health_samples": samples}  # fmt: skip


@contextmanager
def _sampled(server: Server, every_s: float) -> Iterator[list[dict[str, Any]]]:
    """The exported P95 and /health, read every ``every_s`` in a thread while the block runs."""
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    start = time.monotonic()

    def sample() -> None:
        while not stop.wait(every_s):
            p95 = metric_sum(server.metrics(), Metric.LATENCY_P95_SECONDS)
            with urllib.request.urlopen(server.http_url + HEALTH_PATH, timeout=10) as reply:
                health = json.loads(reply.read())
            samples.append({"at_s": round(time.monotonic() - start, 2), "exported_p95_ms": p95 * 1000, **health})

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def run(opts: Options) -> dict[str, Any]:
    wl = workload.load()
    short = [t for t, n in zip(wl.texts, wl.tokens, strict=True) if n <= SHORT_TOKENS]
    result: dict[str, Any] = {"settings": asdict(opts), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"fairness: {', '.join(opts.parts)}; load average {result['loadavg_at_start']}")
    if "lockout" in opts.parts:
        result["lockout"] = lockout(opts, wl.texts, short)
    if "poison" in opts.parts:
        result["poison"] = poison(opts, short)
    result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    machine.write_judged(opts.name, result, headline.fairness_ratios(result), wl.describe())
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--query-rate", type=float, default=5.0, help="one-text queries a second (Poisson)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per load")
    parser.add_argument("--lockout-texts", type=int, default=1024, help="passages in the maximal ingest request")
    parser.add_argument("--attackers", type=int, default=4, help="clients sending maximal requests back to back")
    parser.add_argument("--sample-s", type=float, default=0.5, help="how often the exported P95 is read")
    parser.add_argument("--timeout", type=float, default=30.0, help="client deadline per query, seconds")
    parser.add_argument("--name", default="fairness", help="write bench/results/NAME.json")
    args = parser.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    return run(Options(**{**vars(args), "parts": parts}))


if __name__ == "__main__":
    main()
