"""A call's request id in its log lines: which offered ids are taken, and how a line names its call."""

from __future__ import annotations

import logging

import pytest

from kembed.plumbing import request_log


@pytest.mark.parametrize("offered", ["abc-123", "a" * request_log.MAX_CHARS, "trace:7/1"])
def test_a_usable_id_is_taken(offered: str):
    assert request_log.adopt(offered) == offered


@pytest.mark.parametrize("offered", [None, "", "two words", "line\nforged", "é", "a" * (request_log.MAX_CHARS + 1)])
def test_any_other_is_replaced_by_one_made(offered: str | None):
    made = request_log.adopt(offered)
    assert made != offered and len(made) == 32 and made.isalnum()


def record(**extra: str) -> logging.LogRecord:
    made = logging.LogRecord("kembed.test", logging.INFO, __file__, 1, "hello", (), None)
    made.__dict__.update(extra)
    return made


def test_a_line_names_the_call_it_was_written_in_or_the_one_it_is_given():
    assert request_log._name_the_call(outside := record()) and outside.request == ""  # type: ignore[attr-defined]
    token = request_log.request_id.set("call-1")
    try:
        request_log._name_the_call(inside := record())
        request_log._name_the_call(given := record(request_id="call-2"))  # the engine's: extra=
    finally:
        request_log.request_id.reset(token)
    assert (inside.request, given.request) == ("[call-1] ", "[call-2] ")  # type: ignore[attr-defined]
