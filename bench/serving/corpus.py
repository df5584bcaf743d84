"""A corpus job beside queries: shards of the corpus command against one server, ``python -m bench.serving.corpus``.

One real server as ``bench.serving.priority`` runs it (``KEMBED_FRONTENDS=auto``; ``--env`` adds settings),
and a corpus file: the workload's texts one a line (whitespace runs made one space, so a text is a
line), repeated in order to ``--lines`` lines (0: enough for the shards to outlast the measured
window at the rate of saturation's best window, ``LINES_MARGIN`` times over). Three loads, the server's latency window
between them:

1. **Saturation**: ``bench.serving.priority``'s ingest alone (batch class, ``--concurrency`` closed-loop
   callers of ``--texts`` texts), the same texts as the corpus.
2. **Idle**: queries alone, as in ``bench.serving.priority`` (one short text a call, Poisson arrivals at
   ``--share`` times saturation's embeddings/s).
3. **Shards**: ``--shards`` corpus commands, ``python -m kembed.client embed --shard I/N`` with the
   flags an ``EmbeddingJob``'s pods get (default request size and window, batch class, no progress
   bar, a summary file), started together; once every one has opened its part, the queries beside
   them for a load's duration. The shards then run to their end.

Embeddings/s are the server's own in both loads alike: the rows it computed
(``kembed_batch_size_sum``, queries' rows included) between scrapes of its metrics at the load's
window boundaries, after the warm-up, timed from the server's first answer (or refusal) to the
load's class; the spread is across windows. Beside them: the ingest's and queries' figures as
``bench.serving.priority`` takes them (client side), and each shard's summary file (rows, seconds,
refusals). Then the output: the manifest's parts in order, their rows against the corpus's lines,
and the first and last row of each part (where a shard would drop, repeat or shift a line) against
their lines embedded anew.

Targets: the server's embeddings/s with the shards and queries at least 0.9 of saturation's; no
query refused; query p95 at most the idle p95 plus two batch durations at saturation (as
``bench.serving.priority`` judges); every shard still running when the load ends (else the window
measured the job's tail); the parts hold exactly the corpus's rows, in order, their seams' rows
their lines'. Writes ``bench/results/<--name>.json``; logs go to ``bench/results/corpus*.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import RESULTS_DIR, headline
from bench.serving import priority
from bench.tools import machine, workload
from bench.tools.report import Samples, Spread, metric_sum, worker_figures
from bench.tools.server import Server, running
from kembed.client import EmbedClient
from kembed.client.corpus.parts import growing_path, manifest_path, part_path
from kembed.client.corpus.reader import Shard
from kembed.config.settings import Settings
from kembed.contract import PRIORITY_LABEL, Metric
from kembed.policy.priority import Priority

ROWS = Metric.BATCH_SIZE + "_sum"  # rows the server computed
LINES_MARGIN = 2.0  # corpus lines over what saturation's best window computes in a load: shards outlast it
START_POLL_S = 0.2  # the server's metrics, read until a load's first request (each read costs it a little)
START_TIMEOUT_S = 300.0  # for every shard to open its part
END_TIMEOUT_S = 600.0  # for the shards to finish, from their start


@dataclass(frozen=True)
class Options:
    shards: int
    lines: int  # 0: sized from saturation
    load: priority.Options  # the saturation ingest, the queries, the windows


def corpus_lines(texts: Sequence[str], lines: int) -> list[str]:
    """``lines`` lines: the texts in turn, each on one line."""
    return [" ".join(text.split()) for text in itertools.islice(itertools.cycle(texts), lines)]


def lines_for(emb_per_s: float, opts: priority.Options) -> int:
    """Enough lines for the shards to outlast a load (its duration, and a warm-up for the query
    processes to start) at ``emb_per_s``, ``LINES_MARGIN`` times over."""
    return math.ceil(LINES_MARGIN * emb_per_s * (opts.duration + opts.warmup))


def class_requests(samples: Samples, cls: Priority) -> float:
    """Requests of a class the server has answered or refused."""
    labels = {PRIORITY_LABEL: cls.label}
    answered = metric_sum(samples, Metric.REQUEST_DURATION_SECONDS + "_count", **labels)
    return answered + metric_sum(samples, Metric.REJECTED + "_total", **labels)


@contextlib.contextmanager
def scraped(server: Server, opts: priority.Options, cls: Priority) -> Iterator[list[tuple[float, Samples]]]:
    """The server's metrics at the window boundaries of a load about to start, taken by a thread
    while the block runs: from the server's first answer (or refusal) to a request of class ``cls``,
    which is when the load's client processes have started, ``windows + 1`` scrapes from the
    warm-up's end to the load's."""
    scrapes: list[tuple[float, Samples]] = []
    stop, started = threading.Event(), threading.Event()

    def scrape() -> None:
        before = class_requests(server.metrics(), cls)
        while class_requests(server.metrics(), cls) == before:
            if stop.wait(START_POLL_S):
                return
        started.set()
        start = time.monotonic()
        width = (opts.duration - opts.warmup) / opts.windows
        for k in range(opts.windows + 1):
            if stop.wait(max(0.0, start + opts.warmup + k * width - time.monotonic())):
                return
            scrapes.append((time.monotonic(), server.metrics()))

    thread = threading.Thread(target=scrape, name="scrapes", daemon=True)
    thread.start()
    try:
        yield scrapes
    except BaseException:
        stop.set()
        raise
    finally:
        if not started.is_set():  # the load sent nothing: no window to measure
            stop.set()
        thread.join()


def server_windows(scrapes: Sequence[tuple[float, Samples]]) -> dict[str, Any]:
    """Rows the server computed per second in each window between scrapes (median and range), and
    each window's worker figures: whether it was fed (busy share), and how fast the machine let it
    compute (padded tokens per compute-second)."""
    windows = [
        {"emb_per_s": (metric_sum(b, ROWS) - metric_sum(a, ROWS)) / (tb - ta), **worker_figures(a, b, tb - ta)}
        for (ta, a), (tb, b) in itertools.pairwise(scrapes)
    ]
    return {"emb_per_s": Spread.of([w["emb_per_s"] for w in windows]).to_dict(), "windows": windows}


def shard_command(target: str, corpus: Path, output: Path, shard: Shard, summary: Path) -> list[str]:
    """One shard's corpus command, with the flags an ``EmbeddingJob``'s pod gets."""
    command = [sys.executable, "-m", "kembed.client", "embed", "--target", target, "--input", str(corpus)]
    return [*command, "--output", str(output), "--shard", str(shard), "--no-progress", "--summary-file", str(summary)]


class Shards:
    """The shards' processes, started together, each logging to ``bench/results/corpus_shard_I.log``."""

    def __init__(self, target: str, corpus: Path, output: Path, count: int) -> None:
        self.shards = [Shard(i, count) for i in range(count)]
        self._output = output
        self._summaries = [output.with_name(f"summary-{shard.index}.json") for shard in self.shards]
        self._logs = [RESULTS_DIR / f"corpus_shard_{shard.index}.log" for shard in self.shards]
        self._commands = [
            shard_command(target, corpus, output, shard, summary)
            for shard, summary in zip(self.shards, self._summaries, strict=True)
        ]
        self._procs: list[subprocess.Popen[bytes]] = []
        self.started = math.nan

    def __enter__(self) -> Shards:
        self.started = time.monotonic()
        for command, log in zip(self._commands, self._logs, strict=True):
            with log.open("wb") as out:
                self._procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))
        return self

    def __exit__(self, *_: object) -> None:
        for proc in self._procs:  # ended already, unless the bench failed
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def wait_open(self) -> None:
        """Until every shard has opened its part, or completed it (so it has connected and read the
        server's Info)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(growing_path(part_path(self._output, shard), "npy").exists() for shard in self.shards):
            if any(proc.poll() not in (None, 0) for proc in self._procs) or time.monotonic() > deadline:
                raise RuntimeError(f"a shard did not start; see {RESULTS_DIR}/corpus_shard_*.log")
            time.sleep(0.1)  # start-up only

    def running(self) -> int:
        return sum(proc.poll() is None for proc in self._procs)

    def finish(self) -> dict[str, Any]:
        """Wait for every shard; their summaries, exit codes and wall time (from the common start)."""
        deadline = self.started + END_TIMEOUT_S
        codes = [proc.wait(max(1.0, deadline - time.monotonic())) for proc in self._procs]
        wall_s = time.monotonic() - self.started
        if codes != [0] * len(codes):
            raise RuntimeError(f"shards exited {codes}; see {RESULTS_DIR}/corpus_shard_*.log")
        summaries = [json.loads(path.read_text()) for path in self._summaries]
        return {"exit_codes": codes, "wall_s": wall_s, "summaries": summaries, **shard_totals(summaries, wall_s)}


def shard_totals(summaries: Sequence[dict[str, Any]], wall_s: float) -> dict[str, float]:
    """The shards together: rows, rows/s (each shard's rows over its own seconds, summed; and all
    rows over the wall time from their common start, start-up and tail included), refusals, retries."""
    return {
        "rows": sum(s["rows"] for s in summaries),
        "rows_per_s": sum(s["embedded"] / s["seconds"] for s in summaries if s["seconds"]),
        "rows_per_wall_s": sum(s["embedded"] for s in summaries) / wall_s,
        "refusals": sum(s["refusals"] for s in summaries),
        "retries": sum(s["retries"] for s in summaries),
        "reconnects": sum(s["reconnects"] for s in summaries),
    }


def seam_rows(counts: Sequence[int]) -> list[int]:
    """The first and the last row of each part that has rows, numbered in the parts concatenated."""
    firsts = itertools.accumulate([0, *counts])
    return sorted({row for first, n in zip(firsts, counts, strict=False) if n for row in (first, first + n - 1)})


def read_parts(output: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """The parts concatenated in the manifest's order, and whether they are the shards' parts in
    order, each holding the rows the manifest says."""
    manifest = json.loads(manifest_path(output).read_text())
    names = [part["path"] for part in manifest["parts"]]
    parts = [np.load(output.parent / name) for name in names]
    counts = [len(part) for part in parts]
    ordered = names == [part_path(output, Shard(i, len(names))).name for i in range(len(names))]
    return np.concatenate(parts), {
        "rows": sum(counts),
        "manifest_rows": manifest["rows"],
        "part_rows": counts,
        "parts_in_order": ordered and counts == [part["rows"] for part in manifest["parts"]],
    }


def check_parts(output: Path, lines: Sequence[str], target: str) -> dict[str, Any]:
    """The output against the corpus: its rows, its parts, and the rows at the parts' ends (where
    a shard would drop, repeat or shift a line) against their lines embedded anew."""
    rows, figures = read_parts(output)
    seams = [row for row in seam_rows(figures["part_rows"]) if row < len(lines)]
    with EmbedClient(target, timeout_s=120) as client:
        anew = client.embed([lines[row] for row in seams], truncate=True)
    got = rows[seams]
    cosines = np.sum(got * anew, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(anew, axis=1))
    return {"lines": len(lines), **figures, "seam_rows": len(seams), "seam_min_cosine": float(cosines.min())}


def measure_shards(
    loads: priority.Loads, server: Server, opts: Options, corpus: Path, lines: list[str], rate: float
) -> dict[str, Any]:
    """The shards, and the queries beside them once they are under way; then the parts checked
    against the corpus's ``lines``."""
    output = corpus.with_name("emb.npy")
    with Shards(server.grpc_target, corpus, output, opts.shards) as shards:
        shards.wait_open()
        with scraped(server, opts.load, Priority.INTERACTIVE) as scrapes:
            figures = loads.measure(interactive=loads.queries(rate))
        running_at_end = shards.running()  # the queries' load has ended: its window with it
        ended = shards.finish()
    return {**figures, "server_windows": server_windows(scrapes), "shards_running_at_end": running_at_end,
            "shards": ended, "output": check_parts(output, lines, server.grpc_target)}  # fmt: skip


def run_loads(server: Server, opts: Options, texts: list[str], queries: list[str], tmp: Path) -> dict[str, Any]:
    """The three loads; ``texts`` (one a line) are the ingest's at saturation and the corpus's."""
    loads = priority.Loads(server, opts.load, texts, queries)
    with scraped(server, opts.load, Priority.BATCH) as scrapes:
        saturation, rate = loads.saturation()
    saturation["server_windows"] = server_windows(scrapes)
    result: dict[str, Any] = {"saturation": saturation, "query_rate": rate}
    result["idle"] = loads.after_pause("idle", interactive=loads.queries(rate))
    # From the best window: a machine that others share may be faster when the shards run.
    lines = corpus_lines(texts, opts.lines or lines_for(saturation["server_windows"]["emb_per_s"]["hi"], opts.load))
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(line + "\n" for line in lines))
    time.sleep(Settings.from_env({}).latency_window_s)  # as after_pause: the idle load forgotten
    result["shards"] = measure_shards(loads, server, opts, corpus, lines, rate)
    print(f"  shards: {_brief(result['shards'])}")
    return result


def _brief(shards: dict[str, Any]) -> str:
    s, server = shards["shards"], shards["server_windows"]["emb_per_s"]["median"]
    said = f"server {server:.1f} emb/s; {s['rows']} rows, {s['refusals']} refusals; "
    return said + priority.brief("interactive", shards["interactive"])


def run(opts: Options, env: dict[str, str]) -> dict[str, Any]:
    wl = workload.load()
    settings = {"frontends": "auto", **env}
    result: dict[str, Any] = {"settings": {**asdict(opts), "server": settings}}
    result["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    print(f"corpus: load average {result['loadavg_at_start']}")
    with running(settings, RESULTS_DIR / "corpus.log", module="kembed") as server, tempfile.TemporaryDirectory() as tmp:
        texts = corpus_lines(wl.texts, len(wl.texts))
        result["loads"] = run_loads(server, opts, texts, priority.short_texts(wl), Path(tmp))
    result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    machine.write_judged(opts.load.name, result, headline.corpus_ratios(result), wl.describe())
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=4, help="corpus commands at once, one shard each")
    parser.add_argument("--lines", type=int, default=0, help="corpus lines (0: sized from saturation)")
    parser.add_argument("--concurrency", type=int, default=24, help="closed-loop ingest callers (saturation)")
    parser.add_argument("--texts", type=int, default=16, help="workload texts per ingest call (saturation)")
    parser.add_argument("--share", type=float, default=0.1, help="query calls/s over saturation's emb/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per load")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds at the start of a load not counted")
    parser.add_argument("--windows", type=int, default=4, help="time windows per load, for the spread")
    parser.add_argument("--timeout", type=float, default=30.0, help="client deadline per query or ingest call")
    parser.add_argument("--env", action="append", default=[], metavar="SETTING=VALUE", help="extra server setting")
    parser.add_argument("--name", default="corpus", help="write bench/results/NAME.json")
    args = vars(parser.parse_args(argv))
    env = dict(kv.split("=", 1) for kv in args.pop("env"))
    shards, lines = args.pop("shards"), args.pop("lines")
    load = priority.Options(starve_concurrency=0, **args)  # the starved load is priority's alone
    return run(Options(shards, lines, load), env)


if __name__ == "__main__":
    main()
