"""The protocol between the front ends and the engine: typed frames over a Unix socket.

A frame is a header (``magic``, ``kind``, part count, body bytes), the parts' byte lengths, then the
parts back to back. A part is a raw little-endian array or UTF-8 JSON, so a frame carrying any
number of requests costs one header and one copy each way, with no per-item pickling (measured
against pyzmq and pickled dicts in ``bench/ipc.py``: ``docs/decisions/ipc.md``).

Each kind is declared once below, with the one ``encode`` and the one ``decode`` both sides use.
``decode`` checks what it reads: the part count, each array's size, and that the parts agree (as
many deadlines as requests, as many ids as the lengths add up to...). Anything else raises
:class:`ProtocolError`. A frame that does not parse means the two processes no longer agree about
the stream; it is never worked around: the process that read it exits, and the supervisor takes the
pod down, as it does for a dead child. Never wrong rows.

Front end → engine: :class:`Hello` once (protocol version, front-end index), then :class:`Work`.
Engine → front end: :class:`Ready` once the model is warm (version, :class:`ServingInfo`), then a
:class:`Result` per batch (that front end's rows) and :class:`Errors` (requests refused or failed).
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any, ClassVar, NamedTuple

import numpy as np

from kembed.domain.errors import EmbedError, Failure
from kembed.policy.priority import Priority

PROTOCOL_VERSION = 5  # both ends come from one install; a difference is a broken image
MAGIC = 0x6B65  # "ke": a stream read out of step fails here, not somewhere in the rows
HEADER = struct.Struct("<HBHI")  # magic, kind, parts, body bytes
NEWLINE = ord("\n")  # ends each request id in a WORK frame
SHORT_PART = 64  # values: a part up to this long is checked in Python (see Span)
MOST_PRIORITY = max(Priority)

Part = np.ndarray | bytes


class Kind(IntEnum):
    HELLO = 1
    WORK = 2
    READY = 3
    RESULT = 4
    ERRORS = 5


class ProtocolError(RuntimeError):
    """A frame that is not what the protocol says: the link cannot be trusted any more."""


class LinkClosed(ConnectionError):
    """The peer went away: for a front end that means the engine died."""


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _read_json(kind: Kind, parts: Sequence[memoryview]) -> Any:
    _expect_parts(kind, parts, 1)
    try:
        return json.loads(bytes(parts[0]))
    except ValueError as error:
        raise ProtocolError(f"{kind.name}: not JSON ({error})") from None


def _expect_parts(kind: Kind, parts: Sequence[memoryview], count: int) -> None:
    if len(parts) != count:
        raise ProtocolError(f"{kind.name}: {len(parts)} parts, expected {count}")


Layout = Sequence[tuple[str, np.dtype]]  # each part's name and dtype, in order


def _layout(*parts: tuple[str, str]) -> tuple[tuple[str, np.dtype], ...]:
    """A kind's parts, their dtypes made once: ``np.dtype`` of a string costs more than the part's read."""
    return tuple((name, np.dtype(dtype)) for name, dtype in parts)


def _read_arrays(kind: Kind, parts: Sequence[memoryview], layout: Layout) -> list[np.ndarray]:
    """Each part as a 1-D array of its declared dtype: views of the frame's bytes, no copy."""
    _expect_parts(kind, parts, len(layout))
    arrays = []
    for part, (name, dtype) in zip(parts, layout, strict=True):
        if len(part) % dtype.itemsize:
            raise ProtocolError(f"{kind.name}.{name}: {len(part)} bytes is not a whole number of {dtype.str}")
        arrays.append(np.frombuffer(part, dtype=dtype))
    return arrays


class Span(NamedTuple):
    """The least, the most and the sum of an integer part's values: ``(1, 0, 0)`` when it is empty
    (every value of none is at least 1, and at most anything)."""

    least: int
    most: int
    total: int

    @classmethod
    def of(cls, part: np.ndarray) -> Span:
        """Read as a Python list when short: a frame of a request or two, where numpy's three calls
        cost several times more."""
        if not part.size:
            return cls(1, 0, 0)
        if part.size <= SHORT_PART:
            values = part.tolist()
            return cls(min(values), max(values), sum(values))
        return cls(int(part.min()), int(part.max()), int(part.sum()))


def _check(kind: Kind, condition: bool, what: str) -> None:
    if not condition:
        raise ProtocolError(f"{kind.name}: {what}")


def check_version(peer: int) -> None:
    if peer != PROTOCOL_VERSION:
        raise ProtocolError(
            f"the peer speaks protocol {peer}, this process {PROTOCOL_VERSION}: front ends and engine "
            "come from different kembed installs"
        )


@dataclass(frozen=True)
class ServingInfo:
    """What front ends need from the warm engine: the model's limits, the plan, the tokenizer."""

    model_id: str
    dimensions: int
    max_input_tokens: int
    vocab_size: int
    pad_token_id: int
    pooling: str
    excluded_token_ids: Sequence[int]
    tokenizer_fingerprint: str
    dtype: str
    device: str
    bucket_lengths: list[int]
    batch_sizes: list[int]
    tokenizer_json: str  # the engine's tokenizer, so every process splits text the same way
    prompts: dict[str, str] = field(default_factory=dict)  # the model's, by name (kembed.domain.prompts)
    default_prompt_name: str = ""  # the one a request that picks none gets; empty: none


@dataclass(frozen=True)
class Hello:
    kind: ClassVar[Kind] = Kind.HELLO
    version: int
    frontend: int  # the front end's index

    def encode(self) -> list[Part]:
        return [_json({"version": self.version, "frontend": self.frontend})]

    @classmethod
    def decode(cls, parts: Sequence[memoryview]) -> Hello:
        data = _read_json(cls.kind, parts)
        try:
            return cls(version=int(data["version"]), frontend=int(data["frontend"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ProtocolError(f"HELLO: {error!r}") from None


@dataclass(frozen=True)
class Ready:
    kind: ClassVar[Kind] = Kind.READY
    version: int
    info: ServingInfo

    def encode(self) -> list[Part]:
        return [_json({"version": self.version, "info": asdict(self.info)})]

    @classmethod
    def decode(cls, parts: Sequence[memoryview]) -> Ready:
        data = _read_json(cls.kind, parts)
        try:
            return cls(version=int(data["version"]), info=ServingInfo(**data["info"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ProtocolError(f"READY: {error!r}") from None


@dataclass(frozen=True)
class Work:
    """Every request a front end took since its last frame, with its cancellations and latency samples."""

    kind: ClassVar[Kind] = Kind.WORK
    tags: np.ndarray  # uint64 [requests]: the front end's ids for them
    deadlines: np.ndarray  # float64 [requests], monotonic seconds (one clock for every process on the host)
    counts: np.ndarray  # uint32 [requests]: items per request, each >= 1
    costs: np.ndarray  # uint64 [requests]: padded tokens, as the front end admitted it
    priorities: np.ndarray  # uint8 [requests]: each a Priority
    lengths: np.ndarray  # int32 [items], each >= 1
    ids: np.ndarray  # int32 [tokens]
    cancels: np.ndarray  # uint64: tags nobody waits for any more
    latencies: np.ndarray  # float64: server-side latency samples for the P95 windows
    sample_priorities: np.ndarray  # uint8 [latencies]: whose window each sample goes to
    sample_refused: np.ndarray  # uint8 [latencies]: 1 for a refusal's (the wait it spared), 0 for a served request's
    # uint8: each request's id as its log lines name it, ASCII, each ended by a newline (join_request_ids)
    request_ids: np.ndarray
    LAYOUT: ClassVar = _layout(
        ("tags", "<u8"),
        ("deadlines", "<f8"),
        ("counts", "<u4"),
        ("costs", "<u8"),
        ("priorities", "u1"),
        ("lengths", "<i4"),
        ("ids", "<i4"),
        ("cancels", "<u8"),
        ("latencies", "<f8"),
        ("sample_priorities", "u1"),
        ("sample_refused", "u1"),
        ("request_ids", "u1"),
    )

    def encode(self) -> list[Part]:
        return [np.ascontiguousarray(getattr(self, name), dtype=dtype) for name, dtype in self.LAYOUT]

    @classmethod
    def decode(cls, parts: Sequence[memoryview]) -> Work:
        work = cls(*_read_arrays(cls.kind, parts, cls.LAYOUT))
        requests = work.tags.size
        per_request = (work.deadlines, work.counts, work.costs, work.priorities)
        _check(cls.kind, all(part.size == requests for part in per_request), "per-request parts")
        samples = (work.sample_priorities.size, work.sample_refused.size)
        _check(cls.kind, samples == (work.latencies.size,) * 2, "a class and a kind per latency sample")
        priorities = max(Span.of(work.priorities).most, Span.of(work.sample_priorities).most)
        _check(cls.kind, priorities <= MOST_PRIORITY, "an unknown priority")
        counts, lengths = Span.of(work.counts), Span.of(work.lengths)
        _check(cls.kind, counts.least >= 1 and lengths.least >= 1, "an empty request or item")
        _check(cls.kind, counts.total == work.lengths.size, "counts do not add up to the lengths")
        _check(cls.kind, lengths.total == work.ids.size, "lengths do not add up to the ids")
        _check(cls.kind, np.count_nonzero(work.request_ids == NEWLINE) == requests, "a request id per request")
        return work

    def request_id_list(self) -> list[str]:
        """Each request's id: read only to write a log line, never for a row."""
        return self.request_ids.tobytes().decode("ascii", "replace").split("\n")[:-1]


def join_request_ids(request_ids: Sequence[str]) -> np.ndarray:
    """The ``request_ids`` part of a frame: ids are ASCII without a newline (``request_log.adopt``)."""
    return np.frombuffer("".join(f"{name}\n" for name in request_ids).encode("ascii"), dtype="u1")


@dataclass(frozen=True)
class Result:
    """One batch's rows for one front end: row ``i`` is item ``slots[i]`` of request ``tags[i]``."""

    kind: ClassVar[Kind] = Kind.RESULT
    started: float  # when the batch started (monotonic seconds)
    seconds: float  # its compute time
    tags: np.ndarray  # uint64 [rows]
    slots: np.ndarray  # uint32 [rows]
    rows: np.ndarray  # float32 [rows, dimensions]
    LAYOUT: ClassVar = _layout(("timing", "<f8"), ("tags", "<u8"), ("slots", "<u4"), ("rows", "<f4"))

    def encode(self) -> list[Part]:
        timing = np.array([self.started, self.seconds], dtype="<f8")
        rows = np.ascontiguousarray(self.rows, dtype="<f4")  # already float32 from the worker: no copy
        return [timing, np.ascontiguousarray(self.tags, "<u8"), np.ascontiguousarray(self.slots, "<u4"), rows]

    @classmethod
    def decode(cls, parts: Sequence[memoryview]) -> Result:
        timing, tags, slots, rows = _read_arrays(cls.kind, parts, cls.LAYOUT)
        _check(cls.kind, timing.size == 2 and tags.size == slots.size > 0, "timing, tags and slots")
        _check(cls.kind, rows.size % tags.size == 0, "rows do not divide among the tags")
        started, seconds = timing.tolist()
        return cls(started, seconds, tags, slots, rows.reshape(tags.size, rows.size // tags.size))


@dataclass(frozen=True)
class Errors:
    """Requests the engine refused or failed, each with its domain failure."""

    kind: ClassVar[Kind] = Kind.ERRORS
    tags: list[int]
    errors: list[EmbedError]

    def encode(self) -> list[Part]:
        return [
            _json(
                [[tag, e.failure, e.message, e.retry_after_ms] for tag, e in zip(self.tags, self.errors, strict=True)]
            )
        ]

    @classmethod
    def decode(cls, parts: Sequence[memoryview]) -> Errors:
        tags, errors = [], []
        try:
            for tag, failure, message, retry_after_ms in _read_json(cls.kind, parts):
                tags.append(int(tag))
                errors.append(EmbedError(Failure(failure), str(message), int(retry_after_ms)))
        except (TypeError, ValueError) as error:
            raise ProtocolError(f"ERRORS: {error!r}") from None
        return cls(tags, errors)


Message = Hello | Ready | Work | Result | Errors
_MESSAGES: dict[Kind, type[Message]] = {m.kind: m for m in (Hello, Ready, Work, Result, Errors)}


def frame(message: Message) -> list[bytes | memoryview]:
    """The message as one frame's buffers: its header, then its parts (the arrays not copied)."""
    buffers = [part.data.cast("B") if isinstance(part, np.ndarray) else part for part in message.encode()]
    sizes = [len(buffer) for buffer in buffers]
    header = HEADER.pack(MAGIC, message.kind, len(sizes), sum(sizes)) + struct.pack(f"<{len(sizes)}I", *sizes)
    return [header, *buffers]


def send(writer: asyncio.StreamWriter, message: Message) -> None:
    """Queue one frame on the stream (asyncio writes it when the socket takes it)."""
    writer.writelines(frame(message))


async def receive(reader: asyncio.StreamReader) -> Message:
    """The next message; :class:`LinkClosed` when the peer has gone, :class:`ProtocolError` when
    what arrived is not a frame of this protocol."""
    try:
        magic, kind, count, body_bytes = HEADER.unpack(await reader.readexactly(HEADER.size))
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic:#06x}: the stream is out of step")
        sizes = struct.unpack(f"<{count}I", await reader.readexactly(4 * count))
        if sum(sizes) != body_bytes:
            raise ProtocolError(f"parts of {sum(sizes)} bytes in a body of {body_bytes}")
        body = memoryview(await reader.readexactly(body_bytes))
    except (asyncio.IncompleteReadError, ConnectionError) as error:
        raise LinkClosed(str(error) or "connection closed") from None
    if kind not in _MESSAGES:
        raise ProtocolError(f"unknown frame kind {kind}")
    parts, offset = [], 0
    for size in sizes:
        parts.append(body[offset : offset + size])
        offset += size
    return _MESSAGES[Kind(kind)].decode(parts)
