"""The priority benchmark's machinery in seconds: two loads at once in one client process (against
the echo), the requests of each class, and the arithmetic that judges the targets. kembed itself is
never started here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import headline
from bench.serving import priority
from bench.tools import loadgen
from bench.tools.loadgen import OK, CallRecord
from bench.tools.report import Spread
from bench.tools.server import echo_running
from kembed.policy.priority import Priority
from kembed.v1 import embedder_pb2

OPTS = priority.Options(
    concurrency=4, texts=2, share=0.1, starve_concurrency=8, duration=4, warmup=0, windows=2, timeout=10, name="x"
)


def test_requests_carry_their_class_and_texts_in_turn() -> None:
    calls = [embedder_pb2.EmbedRequest.FromString(c) for c in priority.requests(["a", "b", "c"], 2, Priority.BATCH)]
    assert [list(c.texts) for c in calls] == [["a", "b"]]
    assert {c.priority for c in calls} == {embedder_pb2.PRIORITY_BATCH} and calls[0].truncate
    query = embedder_pb2.EmbedRequest.FromString(priority.requests(["q"], 1, Priority.INTERACTIVE)[0])
    assert not query.HasField("normalize") and query.priority == embedder_pb2.PRIORITY_INTERACTIVE


@pytest.mark.process
def test_two_loads_run_together_in_one_client_process(tmp_path: Path) -> None:
    request = embedder_pb2.EmbedRequest(texts=["x"]).SerializeToString()
    with echo_running(1, tmp_path / "echo.log") as server:
        loads = [
            ("closed_loop", {"target": server.grpc_target, "requests": [request], "concurrency": 2, "duration": 5,
                             "count": 40, "deadline": 10}),
            ("open_loop", {"target": server.grpc_target, "requests": [request], "rate": 50, "duration": 5,
                           "count": 10, "seed": 1, "deadline": 10}),
        ]  # fmt: skip
        ([closed, opened],), _ = loadgen.in_processes(priority.together, [{"loads": loads}])
    assert (len(closed), len(opened)) == (40, 10)
    assert {o.code for o in closed + opened} == {OK}


def test_embeddings_per_second_count_each_sides_texts() -> None:
    ingest = [CallRecord(0, 0.0, 0.0, t, OK) for t in (0.5, 1.5, 2.5, 3.5)]
    queries = [CallRecord(0, 0.0, 0.0, t, OK) for t in (1.0, 3.0)] + [
        CallRecord(0, 0.0, 0.0, 3.0, "RESOURCE_EXHAUSTED")
    ]
    assert priority.emb_per_s([(ingest, 2)], OPTS) == Spread(2.0, 2.0, 2.0).to_dict()  # 4 texts per 2 s window
    assert priority.emb_per_s([(ingest, 2), (queries, 1)], OPTS) == Spread(2.5, 2.5, 2.5).to_dict()


def _load(batch: dict[str, Any] | None, interactive: dict[str, Any] | None, total: float, batch_ms: float) -> dict:
    sides = {name: side for name, side in (("batch", batch), ("interactive", interactive)) if side}
    return {**sides, "total_emb_per_s": Spread(total, total, total).to_dict(),
            "server": {"batch_seconds": batch_ms / 1000, "batches": 10, "rejections": {}}}  # fmt: skip


def _side(emb: float, p95: float, codes: dict[str, int] | None = None) -> dict[str, Any]:
    return {"calls": 10, "codes": codes or {OK: 10}, "emb_per_s": Spread(emb, emb, emb).to_dict(),
            "latency_ms": {"p50": p95 / 2, "p95": p95, "p99": p95, "max": p95}}  # fmt: skip


def _result(query_p95: float, ingest_p95: float, goodput: float, refused: int = 0) -> dict[str, Any]:
    codes = {OK: 10, "RESOURCE_EXHAUSTED": refused} if refused else None
    return {
        "settings": {"concurrency": 16, "texts": 16, "starve_concurrency": 64},
        "loads": {
            "saturation": _load(_side(50, 3000), None, 50, batch_ms=400),
            "query_rate": 5.0,
            "idle": _load(None, _side(5, 40), 5, batch_ms=20),
            "beside": _load(_side(40, ingest_p95), _side(5, query_p95, codes), goodput, batch_ms=300),
            "one_class": _load(_side(40, 3000), _side(5, 1200, {OK: 8, "RESOURCE_EXHAUSTED": 2}), 45, batch_ms=400),
            "starved": _load(_side(2, 4500), _side(48, 900), 50, batch_ms=100),
        },
    }


def test_priority_ratios_judge_the_targets() -> None:
    rows = {r.name: r for r in headline.priority_ratios(_result(query_p95=600, ingest_p95=3000, goodput=46))}
    allowance = rows["Query p95 beside the ingest / (idle p95 + 2 batch durations: 840 ms)"]
    assert (allowance.value.median, allowance.met()) == (pytest.approx(600 / 840), True)
    assert rows["Query p95 / ingest p95, beside the ingest"].value.median == pytest.approx(0.2)
    goodput = rows["Goodput beside the ingest (queries + ingest) / saturation (emb/s)"]
    assert (goodput.value.median, goodput.met()) == (pytest.approx(0.92), True)
    assert rows["Queries rejected beside the ingest"].met() is True
    assert rows["Query p95 with one class for both / with classes"].value.median == pytest.approx(2.0)
    assert rows["Queries rejected with one class for both"].value.median == 2
    assert rows["Ingest p95 under saturating queries (ms)"].value.median == 4500
    missed = {r.name: r.met() for r in headline.priority_ratios(_result(900, 2000, 40, refused=1))}
    assert missed["Queries rejected beside the ingest"] is False
    assert missed["Query p95 beside the ingest / (idle p95 + 2 batch durations: 840 ms)"] is False
    assert missed["Query p95 / ingest p95, beside the ingest"] is False
    assert missed["Goodput beside the ingest (queries + ingest) / saturation (emb/s)"] is False


def test_priority_table_lists_every_side_of_every_load() -> None:
    table = headline.priority_table(_result(query_p95=600, ingest_p95=3000, goodput=46))
    rows = table.splitlines()[2:]
    assert [row.split(" | ")[0].strip("| ") for row in rows] == [
        "saturation", "idle", "beside", "beside", "one_class", "one_class", "starved", "starved",
    ]  # fmt: skip
    assert "queries, 64 callers" in rows[-1] and "5.0/s Poisson" in rows[1]
