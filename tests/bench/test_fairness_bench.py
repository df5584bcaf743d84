"""The fairness benchmark's machinery in seconds: its requests, and the arithmetic that judges the
targets. kembed itself is never started here."""

from __future__ import annotations

from typing import Any

import pytest

from bench import headline
from bench.serving import fairness
from bench.tools.loadgen import OK
from kembed.v1 import embedder_pb2


def test_passages_are_about_250_words_from_the_texts_in_turn() -> None:
    texts = ["one two three"] * 200
    found = fairness.passages(texts, 4)
    assert len(found) == 4 and {len(p.split()) for p in found} == {fairness.PASSAGE_WORDS}


def test_the_maximal_request_is_the_queue_cap_of_ids_and_interactive() -> None:
    request = embedder_pb2.EmbedRequest.FromString(fairness.maximal_request())
    assert list(request.tokens.lengths) == [256] * 1024 and len(request.tokens.ids) == 4 * 256 * 1024
    assert request.priority == embedder_pb2.PRIORITY_INTERACTIVE and not request.texts


def _side(p95: float, codes: dict[str, int] | None = None) -> dict[str, Any]:
    return {"calls": 10, "codes": codes or {OK: 10}, "latency_ms": {"p50": p95 / 2, "p95": p95, "p99": p95}}


def _result(query_p95: float, refused: int, exported: list[float]) -> dict[str, Any]:
    beside = _side(query_p95, {OK: 10, "RESOURCE_EXHAUSTED": refused} if refused else None)
    return {
        "settings": {"query_rate": 5.0},
        "lockout": {
            "texts": 1024,
            "idle": _side(40),
            "beside": {**beside, "batch_seconds": 0.5},
            "ingest": {"status": 200, "seconds": 70.0},
            "health": [],
        },
        "poison": {
            "attackers": 4,
            "idle": _side(40),
            "beside": _side(100),
            "attack": _side(0, {"RESOURCE_EXHAUSTED": 30, OK: 1}),
            "exported_p95_ms": exported,
            "health": {"healthy": 10, "degraded": 30},
        },
    }


def test_fairness_ratios_judge_the_targets() -> None:
    rows = {r.name: r for r in headline.fairness_ratios(_result(query_p95=800, refused=0, exported=[0, 90, 140]))}
    refused = rows["Queries refused beside a maximal ingest (1024 texts, REST, no priority)"]
    assert (refused.value.median, refused.met()) == (0, True)
    p95 = rows["Query p95 beside it / (idle p95 + 2 batch durations: 1040 ms)"]
    assert (p95.value.median, p95.met()) == (pytest.approx(800 / 1040), True)
    exported = rows["Exported P95 beside 4 clients of refused maximal requests / served queries' p95"]
    assert (exported.value.median, exported.met()) == (pytest.approx(1.4), True)
    assert rows["Maximal requests refused"].value.median == 30
    missed = {r.name: r.met() for r in headline.fairness_ratios(_result(query_p95=1100, refused=2, exported=[160]))}
    assert missed["Queries refused beside a maximal ingest (1024 texts, REST, no priority)"] is False
    assert missed["Query p95 beside it / (idle p95 + 2 batch durations: 1040 ms)"] is False
    assert missed["Exported P95 beside 4 clients of refused maximal requests / served queries' p95"] is False


def test_fairness_table_has_a_row_per_load_and_partial_results() -> None:
    table = headline.fairness_table(_result(query_p95=800, refused=0, exported=[90]))
    assert table.count("\n") == 1 + 4 and "200 after 70 s" in table and "degraded 30" in table
    only_poison = {k: v for k, v in _result(800, 0, [90]).items() if k != "lockout"}
    assert len(headline.fairness_ratios(only_poison)) == 3
