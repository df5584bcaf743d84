"""The front end's pre-screen against the board and its own work in transit (a real socket, a real
board file): a burst read in one loop turn is refused past the drain budget before the engine
has published any of it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from kembed.config.settings import Settings
from kembed.frontend.link import EngineLink
from kembed.frontend.screen import Screen, Waits
from kembed.ipc.board import Board, Cell
from kembed.policy.admission import Rejection
from kembed.policy.priority import Priority
from tests.server.test_link import Engine, linked, seqs

FRONTEND = 1
COST = 128  # padded tokens a request
RATE = 1000.0  # padded tokens a second: a 1 s drain budget holds a few requests


@contextlib.asynccontextmanager
async def screening(tmp_path: Path) -> AsyncIterator[tuple[Screen, Board, EngineLink, Engine]]:
    """A front end's screen over an empty board (the engine has published nothing) and a real link."""
    board = Board(tmp_path / "board", frontends=2)
    board[Cell.TOKENS_PER_SECOND] = RATE
    settings = Settings.from_env({}, max_drain_ms=1000, admission="throughput")
    async with linked(tmp_path / "engine.sock", 3600.0, Engine(takes=False)) as (link, engine):
        yield Screen(settings, board, FRONTEND, link.in_transit, link.add_latency), board, link, engine


async def test_a_burst_is_screened_against_work_the_engine_has_not_taken(tmp_path):
    async with screening(tmp_path) as (screen, _, link, engine):
        loop = asyncio.get_running_loop()
        admitted = 0
        for _ in range(20):  # one loop turn: the board (all zeros) sees none of these
            if screen.before_tokenizing(COST, Priority.INTERACTIVE) is None:
                link.submit(seqs(1), COST, loop.time(), loop.time() + 30, Priority.INTERACTIVE)
                admitted += 1
        assert 1 <= admitted < 20
        refused = screen.before_tokenizing(COST, Priority.INTERACTIVE)
        assert refused is not None and refused.reason == "drain_time"

        await engine.next_work()  # the frame went
        assert screen.before_tokenizing(COST, Priority.INTERACTIVE) is not None  # not taken yet: still ahead
        engine.taken = 1  # the engine took it and published its backlog
        assert screen.before_tokenizing(COST, Priority.INTERACTIVE) is None  # the board holds nothing: all drained


async def test_requests_being_tokenized_count_until_they_are_submitted_or_fail(tmp_path):
    async with screening(tmp_path) as (screen, *_):
        with screen.tokenizing(COST, Priority.INTERACTIVE), screen.tokenizing(4 * COST, Priority.INTERACTIVE):
            refused = screen.before_tokenizing(COST, Priority.INTERACTIVE)  # behind two still tokenizing
            assert refused is not None and refused.reason == "drain_time"
        with contextlib.suppress(ValueError), screen.tokenizing(4 * COST, Priority.INTERACTIVE):
            raise ValueError("its input was bad")
        assert screen.before_tokenizing(COST, Priority.INTERACTIVE) is None  # nothing left ahead of it


async def test_a_batch_of_ingest_in_the_worker_does_not_refuse_queries(tmp_path):
    """What the engine publishes of the batches in its worker's hands: the interactive part is
    weighed for a query, the ingest's is not (it delays a query by that batch at most)."""
    async with screening(tmp_path) as (screen, board, *_):
        board[Cell.IN_FLIGHT_TOKENS] = 2048  # two seconds at this rate: over the budget twice over
        assert screen.before_tokenizing(COST, Priority.INTERACTIVE) is None
        assert isinstance(screen.after_tokenizing(COST, Priority.INTERACTIVE), Waits)
        assert screen.before_tokenizing(COST, Priority.BATCH) is not None  # batch work waits for it
        board[Cell.IN_FLIGHT_INTERACTIVE_TOKENS] = 2048  # queries in the worker: ahead of the next one
        assert isinstance(screen.after_tokenizing(COST, Priority.INTERACTIVE), Rejection)


async def test_a_request_too_large_for_the_interactive_share_goes_as_batch_work(tmp_path):
    async with screening(tmp_path) as (screen, *_):
        # At 1,000 tokens/s and a 1 s budget (twice the drain time), one query may hold 250 tokens.
        assert screen.class_of(250, Priority.INTERACTIVE) is Priority.INTERACTIVE
        assert screen.class_of(251, Priority.INTERACTIVE) is Priority.BATCH
        waits = screen.after_tokenizing(250, Priority.INTERACTIVE)
        assert isinstance(waits, Waits) and waits.longest == 0.5
