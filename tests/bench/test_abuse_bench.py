"""bench.serving.abuse's pieces without a server: its bad bodies are maximal and what the REST edge refuses
at once, and its ratios and table are read off a result as bench.plot reads them."""

from __future__ import annotations

from typing import Any

import pytest

from bench import headline
from bench.serving import abuse
from kembed.config.settings import Settings
from kembed.domain.errors import InvalidInput
from kembed.frontend.call import Limits
from kembed.frontend.json_body import Body
from kembed.frontend.rest import READ_CHUNK


@pytest.mark.parametrize("index", [0, 1], ids=["sequences", "texts"])
def test_the_bad_bodies_are_maximal_and_refused_in_their_first_chunk(index: int) -> None:
    settings = Settings()
    body = abuse.bad_bodies(settings.max_message_bytes)[index]
    assert settings.max_message_bytes - 64 < len(body) <= settings.max_message_bytes
    with pytest.raises(InvalidInput):
        Body(Limits.of(settings)).feed(body[:READ_CHUNK])


def phase(models_p99: float, info_p99: float, **abuser: Any) -> dict[str, Any]:
    def ping(p99: float) -> dict[str, Any]:
        return {"pings": 100, "codes": {"OK": 100}, "latency_ms": {"p50": 1.0, "p95": 2.0, "p99": p99, "max": p99}}

    return {"pings": {"models": ping(models_p99), "info": ping(info_p99)}, **({"abuser": abuser} if abuser else {})}


def test_each_abused_phase_is_judged_against_the_idle_one() -> None:
    result = {
        "phases": {
            "idle": phase(2.0, 4.0),
            "bad_bodies": phase(4.0, 16.0, bodies=10, codes={"400": 10}),
            "slow_bodies": phase(6.0, 8.0, opened=5, most_held=5),
        }
    }
    rows = headline.abuse_ratios(result)
    assert [(row.value.median, row.met()) for row in rows] == [(2.0, True), (4.0, False), (3.0, True), (2.0, True)]
    table = headline.abuse_table(result)
    assert table.count("\n") == 2 + 2 * len(headline.ABUSE_PHASES) - 1 and "most_held 5" in table
