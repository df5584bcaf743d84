"""Between the front ends and the engine: frames of contiguous arrays over a Unix socket, and a
shared-memory board on which the engine publishes what front ends admit against.

A frame is ``u32 body bytes, u8 kind, u16 parts``, the parts' byte lengths (``u32`` each), then the
parts back to back. A part is a raw little-endian array or UTF-8 JSON, so a frame carrying any
number of requests costs one header and one copy each way: no per-item pickling. Measured against
the alternatives in ``bench/ipc.py`` (see the README's "Choices").

Every front end holds one connection. Front end → engine: ``HELLO`` once, then ``WORK`` frames
(new requests, cancellations and latency samples; grouped per frame interval under load). Engine → front
end: ``READY`` once the model is warm (the serving info, tokenizer included), ``RESULT`` per batch
(that front end's rows) and ``ERRORS`` (requests the engine refused or failed).
"""

from __future__ import annotations

import asyncio
import json
import mmap
import struct
import time
from dataclasses import asdict, dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

HEADER = struct.Struct("<IBH")
ENGINE_SOCKET = "engine.sock"
BOARD_FILE = "board"
METRICS_DIR = "metrics"
# What the engine loads the model with, as ``module:callable``; benchmarks swap in a zero-cost one.
DEFAULT_MODEL_LOADER = "kembed.engine.model:EmbeddingModel.load"


class Kind(IntEnum):
    HELLO = 1
    WORK = 2
    READY = 3
    RESULT = 4
    ERRORS = 5


class LinkClosed(ConnectionError):
    """The peer went away: for a front end that means the engine died."""


@dataclass(frozen=True)
class Frame:
    kind: Kind
    parts: list[memoryview]

    def array(self, index: int, dtype: str) -> np.ndarray:
        """Part ``index`` as a 1-D array (a view of the frame's bytes, no copy)."""
        return np.frombuffer(self.parts[index], dtype=dtype)

    def json(self, index: int) -> Any:
        return json.loads(bytes(self.parts[index]))


def _as_bytes(part: np.ndarray | bytes | str) -> bytes | memoryview:
    if isinstance(part, np.ndarray):
        return np.ascontiguousarray(part).data.cast("B")
    return part.encode() if isinstance(part, str) else part


def send(writer: asyncio.StreamWriter, kind: Kind, *parts: np.ndarray | bytes | str) -> None:
    """Queue one frame on the stream (asyncio writes it when the socket takes it)."""
    buffers = [_as_bytes(part) for part in parts]
    sizes = [len(buffer) for buffer in buffers]
    header = HEADER.pack(sum(sizes), kind, len(sizes)) + struct.pack(f"<{len(sizes)}I", *sizes)
    writer.writelines([header, *buffers])


def encode_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


async def receive(reader: asyncio.StreamReader) -> Frame:
    """The next frame; :class:`LinkClosed` when the peer has gone."""
    try:
        body_bytes, kind, count = HEADER.unpack(await reader.readexactly(HEADER.size))
        sizes = struct.unpack(f"<{count}I", await reader.readexactly(4 * count))
        body = memoryview(await reader.readexactly(body_bytes))
    except (asyncio.IncompleteReadError, ConnectionError) as error:
        raise LinkClosed(str(error) or "connection closed") from None
    parts, offset = [], 0
    for size in sizes:
        parts.append(body[offset : offset + size])
        offset += size
    return Frame(Kind(kind), parts)


@dataclass(frozen=True)
class ServingInfo:
    """What front ends need from the warm engine: the model's limits, the plan, the tokenizer."""

    model_id: str
    dimensions: int
    max_input_tokens: int
    vocab_size: int
    pad_token_id: int
    pooling: str
    excluded_token_ids: list[int]
    tokenizer_fingerprint: str
    dtype: str
    device: str
    bucket_lengths: list[int]
    batch_sizes: list[int]
    tokenizer_json: str  # the engine's tokenizer, so every process splits text the same way

    def to_json(self) -> str:
        return encode_json(asdict(self))

    @classmethod
    def from_json(cls, data: Any) -> ServingInfo:
        return cls(**data)


class Slot(IntEnum):
    """The board's cells (float64 each). Front end ``i`` owns ``FRONTENDS + 2i`` and the next."""

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
    FRONTENDS = 10


FRONTEND_HEARTBEAT = 0
FRONTEND_SERVING = 1


class Board:
    """A few float64 cells in a shared file: one writer per cell, any number of readers.

    Aligned 8-byte stores and loads do not tear on the platforms torch supports, and every reader
    tolerates a value one update old, so no lock is needed.
    """

    def __init__(self, path: Path, frontends: int | None = None) -> None:
        """Open the board at ``path``; with ``frontends``, create it first (the supervisor does)."""
        if frontends is not None:
            path.write_bytes(b"\0" * 8 * (Slot.FRONTENDS + 2 * frontends))
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
        self.cells = np.frombuffer(self._map, dtype=np.float64)
        self.frontends = (len(self.cells) - Slot.FRONTENDS) // 2

    def __getitem__(self, slot: Slot) -> float:
        return float(self.cells[slot])

    def __setitem__(self, slot: Slot, value: float) -> None:
        self.cells[slot] = value

    def frontend(self, index: int, field: int) -> float:
        return float(self.cells[Slot.FRONTENDS + 2 * index + field])

    def set_frontend(self, index: int, field: int, value: float) -> None:
        self.cells[Slot.FRONTENDS + 2 * index + field] = value

    def beat_frontend(self, index: int) -> None:
        self.set_frontend(index, FRONTEND_HEARTBEAT, time.monotonic())
