"""The board: a few float64 cells in a shared file, on which the engine publishes what front ends
admit against (backlog by class, service rate, P95 by class, shedding), and every process its sign
of life.

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

from kembed.policy.priority import Priority


class Cell(IntEnum):
    """The pod's cells; then some per class (:class:`ClassCell`), then some per front end (:class:`FrontendCell`)."""

    ENGINE_READY = 0  # 1 once warm
    DRAINING = 1  # set by the supervisor on SIGTERM
    BACKLOG_TOKENS = 2  # padded tokens queued or in flight, every class
    TOKENS_PER_SECOND = 3  # measured service rate
    SHED_FRACTION = 4
    ENGINE_HEARTBEAT = 5  # time.monotonic() of the engine's last sign of life
    IN_FLIGHT_BATCHES = 6
    DIMENSIONS = 7  # of the served embeddings, once warm
    OPEN_REQUESTS = 8  # admitted by the engine and not yet answered
    IN_FLIGHT_TOKENS = 9  # padded tokens in batches handed to the worker
    DISPLACEABLE_TOKENS = 10  # queued batch tokens of requests none of whose items started
    SATURATION = 11  # 0 to 1: the share of the admission budget the backlog fills
    IN_FLIGHT_INTERACTIVE_TOKENS = 12  # of IN_FLIGHT_TOKENS: the rows of interactive items
    CAPACITY = 13  # padded tokens per second the pod can serve: the demand's denominator (kembed/policy/demand.py)


class ClassCell(IntEnum):
    """The engine's cells for each priority class."""

    QUEUED_TOKENS = 0  # padded tokens queued, not yet in a batch
    WAITING_REQUESTS = 1  # admitted, none of their items started
    P95_SECONDS = 2  # of served requests
    LAPSING_TOKENS = 3  # of QUEUED_TOKENS: what will have expired before the worker could reach it


class FrontendCell(IntEnum):
    HEARTBEAT = 0  # time.monotonic() of the front end's event loop's last turn
    SERVING = 1  # 1 while it answers calls
    FRAMES_TAKEN = 2  # its WORK frames the engine has admitted and published (written by the engine)
    OFFERED_RATE = 3  # padded tokens per second offered to it, admitted or refused (kembed/policy/demand.py)
    OFFERED_AT = 4  # time.monotonic() of OFFERED_RATE's last update


class Board:
    def __init__(self, path: Path, frontends: int | None = None) -> None:
        """Open the board at ``path``; with ``frontends``, create it first (the supervisor does)."""
        if frontends is not None:
            path.write_bytes(b"\0" * 8 * (_FRONTENDS_AT + len(FrontendCell) * frontends))
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
        self._cells = np.frombuffer(self._map, dtype=np.float64)

    @property
    def frontends(self) -> int:
        """How many front ends the board has cells for."""
        return (len(self._cells) - _FRONTENDS_AT) // len(FrontendCell)

    def __getitem__(self, cell: Cell) -> float:
        return float(self._cells[cell])

    def __setitem__(self, cell: Cell, value: float) -> None:
        self._cells[cell] = value

    def of_class(self, priority: Priority, cell: ClassCell) -> float:
        return float(self._cells[_class_at(priority, cell)])

    def set_class(self, priority: Priority, cell: ClassCell, value: float) -> None:
        self._cells[_class_at(priority, cell)] = value

    def frontend(self, index: int, cell: FrontendCell) -> float:
        return float(self._cells[self._at(index, cell)])

    def set_frontend(self, index: int, cell: FrontendCell, value: float) -> None:
        self._cells[self._at(index, cell)] = value

    def beat_frontend(self, index: int) -> None:
        self.set_frontend(index, FrontendCell.HEARTBEAT, time.monotonic())

    @staticmethod
    def _at(index: int, cell: FrontendCell) -> int:
        return _FRONTENDS_AT + len(FrontendCell) * index + cell


_FRONTENDS_AT = len(Cell) + len(ClassCell) * len(Priority)
# Every class cell's index, computed once: the engine writes them after each frame and batch.
_CLASS_AT = {(p, c): len(Cell) + len(ClassCell) * p + c for p in Priority for c in ClassCell}


def _class_at(priority: Priority, cell: ClassCell) -> int:
    return _CLASS_AT[priority, cell]
