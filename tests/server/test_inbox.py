"""RESULT rows scattered into the requests waiting for them, and ERRORS failing them (pure: no socket)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kembed.domain.errors import EmbedError, Failure
from kembed.frontend.inbox import Pending, Waiting
from kembed.ipc.protocol import Errors, ProtocolError, Result
from kembed.policy.priority import Priority

DIMS = 2


def waiting_for(*counts: int) -> tuple[Waiting, list[Pending]]:
    """Requests of these item counts, waiting under tags 1, 2, ..."""
    loop = asyncio.get_running_loop()
    waiting = Waiting(DIMS)
    pendings = [Pending(loop.create_future(), 0.0, count, DIMS, Priority.INTERACTIVE) for count in counts]
    for tag, pending in enumerate(pendings, start=1):
        waiting.add(tag, pending)
    return waiting, pendings


def result(started: float, tags: list[int], slots: list[int]) -> Result:
    rows = np.array([[tag, slot] for tag, slot in zip(tags, slots, strict=True)], dtype=np.float32)
    return Result(started, 0.5, np.array(tags, "<u8"), np.array(slots, "<u4"), rows)


async def test_rows_land_in_their_slots_across_batches_and_complete_the_request() -> None:
    waiting, (first, second) = waiting_for(3, 1)
    waiting.scatter(result(10.0, [1, 1, 2], [2, 0, 0]))  # two batches hold the first request's items
    assert not first.future.done() and second.future.done()
    waiting.scatter(result(11.0, [1], [1]))
    assert first.future.done()
    assert first.embeddings.tolist() == [[1, 0], [1, 1], [1, 2]]
    assert (first.inference_s, first.last_start, first.remaining) == (1.0, 11.0, 0)


async def test_rows_of_a_request_nobody_waits_for_are_dropped() -> None:
    waiting, (first,) = waiting_for(1)
    assert waiting.discard(1) and not waiting.discard(1)
    waiting.scatter(result(1.0, [1], [0]))  # timed out meanwhile: nothing to do
    assert not first.future.done()


@pytest.mark.parametrize(
    ("tags", "slots", "rows"),
    [([1], [5], None), ([1, 1, 1], [0, 1, 0], None), ([1], [0], np.zeros((1, DIMS + 1), np.float32))],
    ids=["a slot past the request", "more rows than items", "rows of other dimensions"],
)
async def test_rows_that_do_not_fit_are_a_protocol_error(tags: list[int], slots: list[int], rows) -> None:
    waiting, _ = waiting_for(2)
    sent = result(1.0, tags, slots)
    if rows is not None:
        sent = Result(1.0, 0.5, sent.tags, sent.slots, rows)
    with pytest.raises(ProtocolError):
        waiting.scatter(sent)


async def test_errors_fail_the_requests_still_waited_for() -> None:
    waiting, (first, second) = waiting_for(1, 1)
    refused = EmbedError(Failure.REJECTED, "no room", 200)
    waiting.fail(Errors([2, 7], [refused, refused]))  # 7: nobody waits for it
    assert second.future.exception() is refused and not first.future.done()
