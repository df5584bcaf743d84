"""The corpus benchmark's machinery: the corpus it builds, the shards' command, the server's
embeddings/s from its counters, the output's check (parts written by the corpus command's own
manifest code), and the arithmetic that judges the targets; then, marked slow, one tiny run
against a real server."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import headline
from bench.serving import corpus, priority
from bench.tools.loadgen import OK
from bench.tools.report import Spread, parse_prometheus
from kembed.client.corpus.command import parser
from kembed.client.corpus.parts import part_path, write_manifest
from kembed.client.corpus.reader import Shard
from kembed.contract import Metric
from kembed.policy.priority import Priority

LOAD = priority.Options(
    concurrency=4, texts=2, share=0.1, starve_concurrency=0, duration=6, warmup=2, windows=2, timeout=10, name="x"
)


def test_the_corpus_is_the_texts_in_turn_one_a_line() -> None:
    texts = ["first text", "a docstring\nover two lines,\r\n  indented", "last"]
    lines = corpus.corpus_lines(texts, 7)
    assert lines == corpus.corpus_lines(texts, 7)  # deterministic
    assert lines[:3] == ["first text", "a docstring over two lines, indented", "last"]
    assert lines[3:] == lines[:3] + lines[:1]
    assert not any("\n" in line or "\r" in line for line in lines)


def test_the_corpus_outlasts_a_load_at_saturation_rate() -> None:
    lines = corpus.lines_for(100.0, LOAD)  # a load's 6 s, and a warm-up of 2 for its processes to start
    assert lines == 100 * 8 * corpus.LINES_MARGIN
    assert corpus.lines_for(0.55, LOAD) == 9  # rounded up


def test_a_shard_runs_with_the_flags_an_embedding_jobs_pod_gets(tmp_path: Path) -> None:
    command = corpus.shard_command("127.0.0.1:1", tmp_path / "in.txt", tmp_path / "o.npy", Shard(2, 4), tmp_path / "s")
    assert command[1:5] == ["-m", "kembed.client", "embed", "--target"]
    args = parser().parse_args(command[4:])  # the command's own parser takes them
    assert (args.shard, args.progress, args.summary_file) == (Shard(2, 4), False, tmp_path / "s")
    assert (args.batch_texts, args.in_flight, args.priority) == (32, 8, "batch")  # the defaults, as in a pod


def _scrape(at: float, rows: float, compute_s: float) -> tuple[float, Any]:
    text = f"{corpus.ROWS} {rows}\n{Metric.INFERENCE_SECONDS}_sum {compute_s}\n"
    return at, parse_prometheus(text)


def test_the_servers_rows_per_second_and_busy_share_are_taken_between_scrapes() -> None:
    scrapes = [_scrape(10.0, 100, 5.0), _scrape(12.0, 300, 7.0), _scrape(14.5, 400, 8.0)]
    figures = corpus.server_windows(scrapes)
    assert figures["emb_per_s"] == Spread(70.0, 40.0, 100.0).to_dict()  # 200 / 2 s, 100 / 2.5 s
    assert [w["busy_share"] for w in figures["windows"]] == [1.0, 0.4]  # 2 s of 2, 1 s of 2.5
    assert math.isnan(corpus.server_windows(scrapes[:1])["emb_per_s"]["median"])  # no window


def test_a_class_requests_count_answers_and_refusals_of_that_class_only() -> None:
    text = "\n".join([
        f'{Metric.REQUEST_DURATION_SECONDS}_count{{priority="batch"}} 3',
        f'{Metric.REQUEST_DURATION_SECONDS}_count{{priority="interactive"}} 5',
        f'{Metric.REJECTED}_total{{reason="drain_time",priority="batch"}} 4',
        f'{Metric.REJECTED}_total{{reason="queue_cap",priority="batch"}} 1',
    ])  # fmt: skip
    samples = parse_prometheus(text)
    assert corpus.class_requests(samples, Priority.BATCH) == 8
    assert corpus.class_requests(samples, Priority.INTERACTIVE) == 5


def test_the_shards_totals_count_each_shard_over_its_own_time() -> None:
    summaries = [
        {"rows": 100, "embedded": 100, "seconds": 10.0, "refusals": 2, "retries": 3, "reconnects": 0},
        {"rows": 60, "embedded": 50, "seconds": 5.0, "refusals": 0, "retries": 0, "reconnects": 1},
    ]
    totals = corpus.shard_totals(summaries, wall_s=15.0)
    assert totals == {"rows": 160, "rows_per_s": 20.0, "rows_per_wall_s": 10.0, "refusals": 2, "retries": 3,
                      "reconnects": 1}  # fmt: skip


def test_the_seams_are_each_parts_first_and_last_rows() -> None:
    assert corpus.seam_rows([3, 0, 1, 2]) == [0, 2, 3, 4, 5]
    assert corpus.seam_rows([0, 0]) == []


def _parts(output: Path, counts: list[int]) -> np.ndarray:
    """Parts of ``counts`` rows (row i holds i) and their manifest, by the corpus command's own code."""
    rows = np.arange(sum(counts), dtype=np.float32)[:, None].repeat(4, axis=1)
    first = 0
    for index, n in enumerate(counts):
        np.save(part_path(output, Shard(index, len(counts))), rows[first : first + n])
        first += n
    assert write_manifest(output, len(counts), "npy") is not None
    return rows


def test_the_parts_are_read_in_the_manifests_order(tmp_path: Path) -> None:
    output = tmp_path / "emb.npy"
    rows = _parts(output, [3, 0, 2])
    got, figures = corpus.read_parts(output)
    assert np.array_equal(got, rows)
    assert figures == {"rows": 5, "manifest_rows": 5, "part_rows": [3, 0, 2], "parts_in_order": True}


def test_parts_the_manifest_lists_out_of_order_are_seen(tmp_path: Path) -> None:
    output = tmp_path / "emb.npy"
    _parts(output, [2, 2])
    manifest = output.with_name("emb.manifest.json")
    written = json.loads(manifest.read_text())
    written["parts"].reverse()
    manifest.write_text(json.dumps(written))
    assert corpus.read_parts(output)[1]["parts_in_order"] is False


def _load(sides: dict[str, Any], batch_ms: float, server_emb: float | None = None) -> dict[str, Any]:
    load = {**sides, "server": {"batch_seconds": batch_ms / 1000, "batches": 10, "rejections": {}}}
    if server_emb is not None:
        windows = [{"emb_per_s": server_emb, "busy_share": 0.97, "padded_tokens_per_compute_s": 9000.0}]
        emb = Spread(server_emb, server_emb - 5, server_emb + 5).to_dict()
        load["server_windows"] = {"emb_per_s": emb, "windows": windows}
    return load


def _side(emb: float, p95: float, codes: dict[str, int] | None = None) -> dict[str, Any]:
    return {"calls": 10, "codes": codes or {OK: 10}, "emb_per_s": Spread(emb, emb, emb).to_dict(),
            "latency_ms": {"p50": p95 / 2, "p95": p95, "p99": p95, "max": p95}}  # fmt: skip


def _result(delivered: float, query_p95: float, refused: int = 0, running: int = 4, rows: int = 1000) -> dict:
    codes = {OK: 10, "RESOURCE_EXHAUSTED": refused} if refused else None
    summaries = [{"rows": rows // 4, "embedded": rows // 4, "seconds": 25.0, "refusals": 3, "retries": 3,
                  "reconnects": 0}] * 4  # fmt: skip
    ran = {"exit_codes": [0] * 4, "wall_s": 30.0, "summaries": summaries, **corpus.shard_totals(summaries, 30.0)}
    output = {"lines": 1000, "rows": rows, "manifest_rows": rows, "part_rows": [rows // 4] * 4,
              "parts_in_order": True, "seam_rows": 8, "seam_min_cosine": 0.99999}  # fmt: skip
    return {
        "settings": {"shards": 4, "lines": 0, "load": {"concurrency": 24, "texts": 16}},
        "loads": {
            "saturation": _load({"batch": _side(48, 3000)}, batch_ms=400, server_emb=50),
            "query_rate": 5.0,
            "idle": _load({"interactive": _side(5, 40)}, batch_ms=20),
            "shards": {
                **_load({"interactive": _side(5, query_p95, codes)}, batch_ms=300, server_emb=delivered),
                "shards_running_at_end": running,
                "shards": ran,
                "output": output,
            },
        },
    }


def test_corpus_ratios_judge_the_targets() -> None:
    rows = {r.name: r for r in headline.corpus_ratios(_result(delivered=46, query_p95=600))}
    delivered = rows["Server emb/s, 4 shards + queries / saturation (server's rows)"]
    assert (delivered.value, delivered.met()) == (Spread(0.92, 41 / 55, 51 / 45), True)
    allowance = rows["Query p95 beside 4 shards / (idle p95 + 2 batch durations: 840 ms)"]
    assert (allowance.value.median, allowance.met()) == (pytest.approx(600 / 840), True)
    assert rows["Queries rejected beside 4 shards"].met() is True
    assert rows["Shards that ended before the measured window did"].met() is True
    assert rows["Rows missing or extra in the parts, in the manifest's order"].met() is True
    assert rows["Rows at the parts' ends against their lines embedded anew, least cosine (8 rows)"].met() is True
    own = rows["Shards' rows/s (each over its own run, summed) / saturation (server's rows)"]
    assert (own.value.median, own.met()) == (pytest.approx(40 / 50), None)  # 4 x 250 rows / 25 s
    missed = {r.name: r.met() for r in headline.corpus_ratios(_result(44, 900, refused=1, running=3, rows=999))}
    assert missed["Server emb/s, 4 shards + queries / saturation (server's rows)"] is False
    assert missed["Queries rejected beside 4 shards"] is False
    assert missed["Query p95 beside 4 shards / (idle p95 + 2 batch durations: 840 ms)"] is False
    assert missed["Shards that ended before the measured window did"] is False
    assert missed["Rows missing or extra in the parts, in the manifest's order"] is False


def test_the_corpus_table_has_every_load_and_the_output() -> None:
    table = headline.corpus_table(_result(delivered=46, query_p95=600))
    lines = table.splitlines()
    assert [line.split(" | ")[0].strip("| ") for line in lines[2:6]] == ["saturation", "idle", "shards", "shards"]
    assert "4 corpus commands, 1000 lines" in lines[4] and "refusals 12" in lines[4]
    assert "| 97% / 9000 |" in lines[4] and "| 97% / 9000 |" in lines[2]  # the server's worker, where it was read
    assert lines[-1].startswith("Output: 1000 rows in 4 parts (250, 250, 250, 250) for 1000 corpus lines")


@pytest.mark.process
def test_a_tiny_run_judges_every_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole benchmark against a real server, with loads too short to mean anything: every
    figure is there and the output check holds (the throughput targets are not judged here)."""
    monkeypatch.setattr(corpus, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(corpus.machine, "RESULTS_DIR", tmp_path)
    flags = ["--duration", "4", "--warmup", "1", "--windows", "1", "--concurrency", "4", "--texts", "4"]
    # No compile beside the loads, no dtype measured at the start (the server's defaults on a CPU):
    # minutes of a busy machine's CPU that no figure checked here depends on (test_cpu_compile's).
    flags += ["--env", "compile=off", "--env", "dtype=float32"]
    result = corpus.main([*flags, "--lines", "300", "--name", "tiny"])
    written = json.loads((tmp_path / "tiny.json").read_text())
    assert written["machine"]["cpu_bf16_flags"] is not None and written["ratios"]
    met = {r["name"]: r["met"] for r in written["ratios"]}
    assert met["Rows missing or extra in the parts, in the manifest's order"] is True
    assert met["Parts out of the shards' order, or not as the manifest counts them"] is True
    seams = next(r for r in written["ratios"] if r["name"].startswith("Rows at the parts' ends"))
    assert seams["met"] is True, seams
    ran = result["loads"]["shards"]["shards"]
    assert ran["rows"] == 300 and all(s["complete"] for s in ran["summaries"])
