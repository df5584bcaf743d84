"""A hundred thousand texts in one call, beside queries: ``python -m bench.serving.client_bulk``.

The library's promise (docs/client.md): ``embed`` takes any number of texts and answers them in
order, splitting them into parts within the server's limits and pacing the parts by its refusals.
One real server (``KEMBED_FRONTENDS=auto``, what a pod runs), three loads, each with a second
client sending one short text at a time (the workload's texts of at most 16 tokens: a search
query), interactive, at ``--query-rate`` calls/s on a steady clock:

1. **Alone**: the queries only, for ``--alone`` seconds.
2. **EmbedClient**: ``client.embed(texts, priority="batch")`` with ``--texts`` short texts (the
   workload's, numbered so that no two are alike) in one call, the queries beside it.
3. **AsyncEmbedClient**: ``await client.embed(...)`` with the same texts, the queries beside it.

Each ingest must answer every text, in order: ``--check`` texts drawn at random are embedded alone
afterwards and their rows compared (cosine at least 0.9999). Reported: the ingest's seconds and
texts/s, its retries (refused parts sent again), and the queries' p50/p95/max and errors during
the ingest and alone. Writes ``bench/results/<--name>.json``; the server's log goes to
``bench/results/client_bulk.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench import RESULTS_DIR
from bench.serving.priority import short_texts
from bench.tools import machine, workload
from bench.tools.report import percentile
from bench.tools.server import running
from kembed.client import AsyncEmbedClient, EmbedClient, EmbedError

SAME_ROW = 0.9999  # the same text in another batch: float rounding apart


def numbered(texts: Sequence[str], count: int) -> list[str]:
    """``count`` texts, the workload's in turn, each numbered: no two alike, so a row out of order shows."""
    return [f"{i}. {texts[i % len(texts)]}" for i in range(count)]


class Queries:
    """One-text interactive calls from their own client at a steady rate, until stopped."""

    def __init__(self, target: str, texts: Sequence[str], rate: float) -> None:
        self._target, self._texts, self._interval = target, texts, 1.0 / rate
        self._stop = threading.Event()
        self.latencies_ms: list[float] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="queries", daemon=True)

    def __enter__(self) -> Queries:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with EmbedClient(self._target, timeout_s=30) as client:
            due = time.monotonic()
            for i in range(10**9):
                if self._stop.wait(max(0.0, due - time.monotonic())):
                    return
                due += self._interval  # a steady clock: a slow answer does not slow the arrivals after it
                started = time.perf_counter()
                try:
                    client.embed([self._texts[i % len(self._texts)]])
                    self.latencies_ms.append((time.perf_counter() - started) * 1000)
                except EmbedError as error:
                    self.errors.append(str(error))

    def summary(self) -> dict[str, Any]:
        lat = self.latencies_ms
        return {
            "calls": len(lat) + len(self.errors),
            "errors": len(self.errors),
            "first_errors": self.errors[:3],
            "p50_ms": round(percentile(lat, 50), 1) if lat else None,
            "p95_ms": round(percentile(lat, 95), 1) if lat else None,
            "max_ms": round(max(lat), 1) if lat else None,
        }


def ingest(
    name: str,
    embed: Callable[[list[str]], tuple[np.ndarray, int]],
    target: str,
    opts: argparse.Namespace,
    texts: list[str],
    queries: list[str],
) -> dict[str, Any]:
    """One ingest of ``texts`` by ``embed`` (rows, retries), the queries beside it, its rows checked."""
    print(f"client_bulk: {name}: {len(texts)} texts in one call, queries at {opts.query_rate}/s beside it")
    error = ""
    with Queries(target, queries, opts.query_rate) as beside:
        started = time.perf_counter()
        try:
            rows, retries = embed(texts)
        except EmbedError as failed:
            rows, retries, error = np.empty((0, 0), np.float32), 0, str(failed)
        seconds = time.perf_counter() - started
    result = {
        "texts": len(texts),
        "rows": int(rows.shape[0]),
        "error": error or None,
        "seconds": round(seconds, 1),
        "texts_per_s": round(len(texts) / seconds, 1),
        "retries": retries,
        "in_order": error == "" and in_order(target, texts, rows, opts.check),
        "queries": beside.summary(),
    }
    print(f"client_bulk: {name}: {result}")
    return result


def in_order(target: str, texts: list[str], rows: np.ndarray, check: int) -> bool:
    """Whether every text has its row: the shape, and ``check`` rows drawn at random against the text alone."""
    if rows.shape[0] != len(texts):
        return False
    picked = random.Random(0).sample(range(len(texts)), min(check, len(texts)))
    with EmbedClient(target, timeout_s=60) as client:
        alone = client.embed([texts[i] for i in picked])
    return bool((np.sum(rows[picked] * alone, axis=1) >= SAME_ROW).all())


def with_embed_client(target: str) -> Callable[[list[str]], tuple[np.ndarray, int]]:
    def embed(texts: list[str]) -> tuple[np.ndarray, int]:
        with EmbedClient(target, timeout_s=3600) as client:
            return client.embed(texts, priority="batch"), client.retries

    return embed


def with_async_client(target: str) -> Callable[[list[str]], tuple[np.ndarray, int]]:
    async def embed_async(texts: list[str]) -> tuple[np.ndarray, int]:
        async with AsyncEmbedClient(target, timeout_s=3600) as client:
            return await client.embed(texts, priority="batch"), client.retries

    return lambda texts: asyncio.run(embed_async(texts))


def alone(target: str, queries: list[str], opts: argparse.Namespace) -> dict[str, Any]:
    print(f"client_bulk: queries alone for {opts.alone} s")
    with Queries(target, queries, opts.query_rate) as only:
        time.sleep(opts.alone)
    return only.summary()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=100_000, help="texts in each ingest's one call")
    parser.add_argument("--query-rate", type=float, default=2.0, help="one-text query calls/s beside it")
    parser.add_argument("--alone", type=float, default=30.0, help="seconds of queries alone")
    parser.add_argument("--check", type=int, default=64, help="rows checked against their text embedded alone")
    parser.add_argument("--name", default="client_bulk", help="write bench/results/NAME.json")
    opts = parser.parse_args(argv)
    wl = workload.load()
    queries = short_texts(wl)
    texts = numbered(queries, opts.texts)
    result: dict[str, Any] = {"settings": vars(opts), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    with running({"frontends": "auto"}, RESULTS_DIR / "client_bulk.log") as server:
        target = server.grpc_target
        result["alone"] = alone(target, queries, opts)
        result["embed_client"] = ingest("EmbedClient", with_embed_client(target), target, opts, texts, queries)
        result["async_client"] = ingest("AsyncEmbedClient", with_async_client(target), target, opts, texts, queries)
    result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    machine.write_result(opts.name, result)
    return result


if __name__ == "__main__":
    main()
