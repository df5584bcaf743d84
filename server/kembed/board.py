"""The board: a few float64 cells in a shared file, on which the engine publishes what front ends
admit against (backlog, service rate, P95, shedding), and every process its sign of life.

One writer per cell, any number of readers. Aligned 8-byte stores and loads do not tear on the
platforms torch supports, and every reader tolerates a value one update old, so no lock is needed.
Front ends read it for every request without a round trip to the engine.
"""

from __future__ import annotations

import mmap
import time
from enum import IntEnum
from pathlib import Path

import numpy as np


class Cell(IntEnum):
    """The pod's cells; then two per front end (:class:`FrontendCell`)."""

    ENGINE_READY = 0  # 1 once warm
    DRAINING = 1  # set by the supervisor on SIGTERM
    BACKLOG_TOKENS = 2  # padded tokens queued or in flight
    TOKENS_PER_SECOND = 3  # measured service rate
    P95_SECONDS = 4
    SHED_FRACTION = 5
    ENGINE_HEARTBEAT = 6  # time.monotonic() of the engine's last sign of life
    IN_FLIGHT_BATCHES = 7
    DIMENSIONS = 8  # of the served embeddings, once warm
    OPEN_REQUESTS = 9  # admitted by the engine and not yet answered


class FrontendCell(IntEnum):
    HEARTBEAT = 0  # time.monotonic() of the front end's event loop's last turn
    SERVING = 1  # 1 while it answers calls


class Board:
    def __init__(self, path: Path, frontends: int | None = None) -> None:
        """Open the board at ``path``; with ``frontends``, create it first (the supervisor does)."""
        if frontends is not None:
            path.write_bytes(b"\0" * 8 * (len(Cell) + len(FrontendCell) * frontends))
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
        self._cells = np.frombuffer(self._map, dtype=np.float64)

    def __getitem__(self, cell: Cell) -> float:
        return float(self._cells[cell])

    def __setitem__(self, cell: Cell, value: float) -> None:
        self._cells[cell] = value

    def frontend(self, index: int, cell: FrontendCell) -> float:
        return float(self._cells[self._at(index, cell)])

    def set_frontend(self, index: int, cell: FrontendCell, value: float) -> None:
        self._cells[self._at(index, cell)] = value

    def beat_frontend(self, index: int) -> None:
        self.set_frontend(index, FrontendCell.HEARTBEAT, time.monotonic())

    @staticmethod
    def _at(index: int, cell: FrontendCell) -> int:
        return len(Cell) + len(FrontendCell) * index + cell
