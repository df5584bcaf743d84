"""The next WORK frame, built from what was queued since the last, and the ledger of work in transit
(pure: no socket; test_link sends frames over a real one)."""

from __future__ import annotations

import numpy as np

from kembed.domain.inputs import Sequences
from kembed.frontend.outbox import InTransit, NextFrame
from kembed.ipc.protocol import Work
from kembed.policy.priority import Priority

INTERACTIVE, BATCH = Priority


def seqs(*lengths: int) -> Sequences:
    total = sum(lengths)
    return Sequences(np.arange(total, dtype=np.int32), np.array(lengths, dtype=np.int32))


def test_a_frame_carries_everything_queued_and_the_next_starts_empty() -> None:
    frame = NextFrame()
    frame.add(5, seqs(2, 1), 48, 30.0, INTERACTIVE, "call-5")
    frame.add(6, seqs(4), 16, 31.0, BATCH, "")
    frame.cancel(3)
    frame.add_latency(0.25, BATCH)
    assert frame.requests == 2
    work = frame.take()
    assert (work.tags.tolist(), work.counts.tolist(), work.costs.tolist()) == ([5, 6], [2, 1], [48, 16])
    assert (work.deadlines.tolist(), work.priorities.tolist()) == ([30.0, 31.0], [INTERACTIVE, BATCH])
    assert (work.lengths.tolist(), work.ids.tolist()) == ([2, 1, 4], [0, 1, 2, 0, 1, 2, 3])
    assert (work.cancels.tolist(), work.latencies.tolist(), work.sample_priorities.tolist()) == ([3], [0.25], [1])
    decoded = Work.decode([memoryview(np.ascontiguousarray(p).tobytes()) for p in work.encode()])
    assert decoded.tags.tolist() == [5, 6] and decoded.request_id_list() == ["call-5", ""]
    empty = frame.take()
    assert frame.requests == 0 and empty.tags.size == empty.ids.size == empty.latencies.size == 0


def test_work_is_in_transit_until_the_engine_has_taken_its_frame() -> None:
    taken = [0]  # the engine's acknowledgement
    ledger = InTransit(lambda: taken[0])
    ledger.queued(32, INTERACTIVE)
    ledger.queued(16, BATCH)
    assert ledger.unconfirmed() == [32, 16]
    ledger.frame_sent()  # frame 1
    ledger.frame_sent()  # frame 2: samples alone
    ledger.queued(64, INTERACTIVE)
    ledger.frame_sent()  # frame 3
    for frames_taken, unconfirmed in ((1, [64, 0]), (2, [64, 0]), (3, [0, 0])):
        taken[0] = frames_taken
        assert ledger.unconfirmed() == unconfirmed
        assert ledger.engine_behind() is (frames_taken < 3)
