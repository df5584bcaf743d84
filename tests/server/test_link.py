"""The front end's link to the engine: how requests are grouped into WORK frames (a real socket).

No assertion bounds how soon a frame arrives (a busy machine is slower, not wrong): a frame that
must not wait is tested with an interval far longer than any test waits, a paced one against the
least time it must have waited."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from kembed.domain.inputs import Sequences
from kembed.frontend.link import EngineLink
from kembed.ipc.protocol import ServingInfo, Work, receive
from kembed.policy.priority import Priority

INTERACTIVE, BATCH = Priority
INTERVAL = 0.2
NEVER = 3600.0  # an interval no test waits for


def serving_info() -> ServingInfo:
    return ServingInfo("test", 4, 16, 100, 0, "mean", [], "", "float32", "cpu", [16], [1, 2], "{}")


def seqs(*ids: int) -> Sequences:
    return Sequences(np.array(ids, dtype=np.int32), np.array([len(ids)], dtype=np.int32))


class Engine:
    """The far end of one link: every frame it receives, with the loop time it arrived, and how many
    it has taken (its acknowledgement on the board): each as it arrives, unless ``takes`` is False."""

    def __init__(self, takes: bool = True) -> None:
        self.frames: asyncio.Queue[tuple[float, Work]] = asyncio.Queue()
        self.takes = takes
        self.taken = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            work = await receive(reader)
            assert isinstance(work, Work)
            self.taken += self.takes
            await self.frames.put((loop.time(), work))

    async def next_work(self) -> tuple[float, Work]:
        return await asyncio.wait_for(self.frames.get(), 120)


@contextlib.asynccontextmanager
async def linked(
    path: Path, frame_interval: float, engine: Engine | None = None
) -> AsyncIterator[tuple[EngineLink, Engine]]:
    engine = engine or Engine()
    server = await asyncio.start_unix_server(engine.serve, str(path))
    reader, writer = await asyncio.open_unix_connection(str(path))
    link = EngineLink(reader, writer, serving_info(), frame_interval, lambda: engine.taken)
    try:
        yield link, engine
    finally:
        link.close()
        server.close()


async def test_overlapping_calls_are_grouped_an_interval_at_a_time(tmp_path):
    async with linked(tmp_path / "engine.sock", INTERVAL) as (link, engine):
        loop = asyncio.get_running_loop()
        sent = loop.time()
        link.submit(seqs(1, 2), 32, sent, sent + 30, INTERACTIVE)
        link.submit(seqs(3), 16, sent, sent + 30, BATCH)  # the same loop turn: the same frame, at once
        link.add_latency(0.5, BATCH)
        _, first = await engine.next_work()
        assert first.tags.tolist() == [1, 2] and first.priorities.tolist() == [INTERACTIVE, BATCH]
        assert (first.latencies.tolist(), first.sample_priorities.tolist()) == ([0.5], [BATCH])

        for _ in range(3):  # the last frame carried two: these wait for the interval, then go together
            link.submit(seqs(3, 4, 5), 16, loop.time(), loop.time() + 30, INTERACTIVE)
        arrived, second = await engine.next_work()
        assert second.tags.tolist() == [3, 4, 5]
        assert second.ids.tolist() == [3, 4, 5] * 3 and second.costs.tolist() == [16] * 3
        assert arrived - sent >= INTERVAL * 0.9, "the second frame went before the interval ended"
        assert engine.frames.empty()


async def test_a_caller_alone_never_waits_for_the_interval(tmp_path):
    async with linked(tmp_path / "engine.sock", NEVER) as (link, engine):
        loop = asyncio.get_running_loop()
        for tag in (1, 2, 3):  # one request a frame, each well within the interval of the last
            sent = loop.time()
            link.submit(seqs(tag), 16, sent, sent + 30, INTERACTIVE)
            _, work = await engine.next_work()
            assert work.tags.tolist() == [tag]


async def test_a_frame_waits_until_the_engine_has_taken_the_last_and_then_carries_all_that_waited(tmp_path):
    engine = Engine(takes=False)  # a busy engine loop: it has not acknowledged a frame yet
    async with linked(tmp_path / "engine.sock", 0.0, engine) as (link, _):
        loop = asyncio.get_running_loop()
        link.submit(seqs(1), 16, loop.time(), loop.time() + 30, INTERACTIVE)
        assert (await engine.next_work())[1].tags.tolist() == [1]  # nothing before it: at once
        for _ in range(3):  # each alone in its loop turn, as gRPC hands calls over
            link.submit(seqs(2), 16, loop.time(), loop.time() + 30, INTERACTIVE)
            await asyncio.sleep(0.02)
        assert engine.frames.empty(), "a frame went before the engine took the last"
        engine.taken = 1
        assert (await engine.next_work())[1].tags.tolist() == [2, 3, 4]
        link.add_latency(0.5, BATCH)  # samples alone wait for the take too
        await asyncio.sleep(0.05)
        assert engine.frames.empty()
        engine.taken = 2
        assert (await engine.next_work())[1].latencies.tolist() == [0.5]


async def test_a_request_cancelled_before_its_frame_went_never_reaches_the_engine(tmp_path):
    engine = Engine(takes=False)
    async with linked(tmp_path / "engine.sock", 0.0, engine) as (link, _):
        loop = asyncio.get_running_loop()
        first, _ = link.submit(seqs(1), 16, loop.time(), loop.time() + 30, INTERACTIVE)
        await engine.next_work()  # sent at once; the next frame waits for the engine to take it
        held, _ = link.submit(seqs(2), 32, loop.time(), loop.time() + 30, INTERACTIVE)
        link.submit(seqs(3), 64, loop.time(), loop.time() + 30, BATCH)
        link.cancel(held)  # its deadline passed while its frame was held
        link.cancel(first)  # in the engine already
        engine.taken = 1
        assert link.in_transit.unconfirmed() == [0, 64]  # the held request's 32 withdrawn
        work = (await engine.next_work())[1]
        assert (work.tags.tolist(), work.cancels.tolist()) == ([3], [first])
        alone, _ = link.submit(seqs(4), 16, loop.time(), loop.time() + 30, INTERACTIVE)
        link.cancel(alone)  # the held frame's only content
        engine.taken = 2
        await asyncio.sleep(0.05)
        assert engine.frames.empty(), "a frame went with nothing in it"


async def test_with_no_interval_each_loop_turn_sends_its_own_frame(tmp_path):
    async with linked(tmp_path / "engine.sock", 0.0) as (link, engine):
        now = asyncio.get_running_loop().time()
        link.submit(seqs(1), 16, now, now + 30, INTERACTIVE)
        link.submit(seqs(2), 16, now, now + 30, INTERACTIVE)  # the same loop turn: the same frame
        await asyncio.sleep(0.01)
        link.submit(seqs(3), 16, now, now + 30, INTERACTIVE)
        assert (await engine.next_work())[1].tags.tolist() == [1, 2]
        assert (await engine.next_work())[1].tags.tolist() == [3]


async def test_work_counts_as_unconfirmed_until_the_engine_takes_its_frame(tmp_path):
    engine = Engine(takes=False)
    async with linked(tmp_path / "engine.sock", NEVER, engine) as (link, _):
        loop = asyncio.get_running_loop()
        link.submit(seqs(1, 2), 32, loop.time(), loop.time() + 30, INTERACTIVE)
        link.submit(seqs(3), 16, loop.time(), loop.time() + 30, BATCH)
        assert link.in_transit.unconfirmed() == [32, 16]  # queued for the first frame
        await engine.next_work()  # frame 1 went at once; the next waits for the engine to take it
        link.submit(seqs(4), 64, loop.time(), loop.time() + 30, INTERACTIVE)
        assert link.in_transit.engine_behind()
        assert link.in_transit.unconfirmed() == [96, 16]  # frame 1 sent, not taken; 64 queued
        engine.taken = 1  # the engine's board counts frame 1 now
        assert not link.in_transit.engine_behind()
        assert link.in_transit.unconfirmed() == [64, 0]
        assert link.in_transit.unconfirmed() == [64, 0]
