"""The protocol between front ends and engine: every kind of frame crosses a real socket and comes
back equal, and every kind of damage is a ProtocolError (never rows from a misread stream)."""

from __future__ import annotations

import asyncio
import dataclasses
import struct
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from kembed.domain.errors import EmbedError, Failure
from kembed.ipc.protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Errors,
    Hello,
    Kind,
    LinkClosed,
    Message,
    ProtocolError,
    Ready,
    Result,
    ServingInfo,
    check_version,
    frame,
    join_request_ids,
    receive,
    send,
)
from kembed.policy.priority import Priority
from tests.server.queueing import work

INFO = ServingInfo(
    model_id="m",
    dimensions=3,
    max_input_tokens=16,
    vocab_size=100,
    pad_token_id=0,
    pooling="mean",
    excluded_token_ids=[5],
    tokenizer_fingerprint="f",
    dtype="float32",
    device="cpu",
    bucket_lengths=[8, 16],
    batch_sizes=[1, 2],
    tokenizer_json="{}",
)
INTERACTIVE, BATCH = Priority
ROWS = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)
MESSAGES: list[Message] = [
    Hello(PROTOCOL_VERSION, 2),
    Ready(PROTOCOL_VERSION, INFO),
    work([[3, 9], [1]], [7, 8], [8, 16], deadline=12.5, cancels=[4], latencies=[0.25], priorities=[BATCH, INTERACTIVE]),
    Result(1.5, 0.25, np.array([7, 7, 8], "<u8"), np.array([1, 0, 0], "<u4"), ROWS),
    Errors([7, 9], [EmbedError(Failure.REJECTED, "busy", 120), EmbedError(Failure.INTERNAL, "boom")]),
]


def same(a: Message, b: Message) -> bool:
    if type(a) is not type(b):
        return False
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or not np.array_equal(x, y):
                return False
        elif field.name == "errors":
            if [vars(e) for e in x] != [vars(e) for e in y]:
                return False
        elif x != y:
            return False
    return True


@pytest.fixture
async def wire() -> AsyncIterator[tuple[asyncio.StreamWriter, asyncio.StreamReader]]:
    """A real socket: what is written at one end is read at the other."""
    accepted: asyncio.Future[asyncio.StreamReader] = asyncio.get_running_loop().create_future()
    server = await asyncio.start_server(lambda r, w: accepted.set_result(r), "127.0.0.1", 0)
    _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    reader = await accepted
    yield writer, reader
    writer.close()
    server.close()


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.kind.name)
async def test_every_kind_crosses_a_socket_unchanged(wire, message: Message) -> None:
    writer, reader = wire
    send(writer, message)
    assert same(await receive(reader), message)


async def test_a_work_frame_of_many_requests_crosses_unchanged(wire) -> None:
    """Parts longer than protocol.SHORT_PART are checked by numpy, not in Python."""
    writer, reader = wire
    many = work([[2] * 80, [1]] * 40, range(80), [8, 16], priorities=[BATCH, INTERACTIVE] * 40)
    send(writer, many)
    assert same(await receive(reader), many)


async def test_frames_follow_one_another(wire) -> None:
    writer, reader = wire
    for message in MESSAGES:
        send(writer, message)
    for message in MESSAGES:
        assert same(await receive(reader), message)


def raw_frame(kind: int, parts: list[bytes]) -> bytes:
    sizes = [len(p) for p in parts]
    header = HEADER.pack(MAGIC, kind, len(parts), sum(sizes)) + struct.pack(f"<{len(sizes)}I", *sizes)
    return header + b"".join(parts)


def frame_bytes(message: Message) -> bytes:
    return b"".join(frame(message))


async def read_bytes(data: bytes, eof: bool = True) -> Message:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return await receive(reader)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.kind.name)
async def test_a_truncated_frame_is_never_read_as_one(message: Message) -> None:
    data = frame_bytes(message)
    for cut in sorted({1, HEADER.size, HEADER.size + 4, len(data) // 2, len(data) - 1}):
        with pytest.raises(LinkClosed):  # the peer died mid-frame: the process exits either way
            await read_bytes(data[:cut])


def corrupt(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value) :]


RESULT = frame_bytes(MESSAGES[3])
WORK = work([[3, 9], [1]], [7, 8], [8, 16])
# Parts longer than protocol.SHORT_PART are checked by numpy, shorter ones in Python: both are damaged.
LONG_WORK = work([[1] * 100] + [[1]] * 99, range(100), [8, 16])
WORK_PARTS = [p.tobytes() if isinstance(p, np.ndarray) else p for p in WORK.encode()]


def work_with(**arrays: np.ndarray) -> bytes:
    return frame_bytes(dataclasses.replace(WORK, **arrays))


def long_work_with(**arrays: np.ndarray) -> bytes:
    return frame_bytes(dataclasses.replace(LONG_WORK, **arrays))


DAMAGE: dict[str, Callable[[], bytes]] = {
    "bad magic": lambda: corrupt(RESULT, 0, b"\x00\x00"),
    "unknown kind": lambda: corrupt(RESULT, 2, bytes([99])),
    "parts disagree with the body": lambda: corrupt(RESULT, 5, struct.pack("<I", 5)),
    "a part of a wrong size": lambda: corrupt(RESULT, HEADER.size, struct.pack("<II", 15, 25)),
    "a missing part": lambda: raw_frame(Kind.WORK, WORK_PARTS[:-1]),
    "rows that do not divide": lambda: frame_bytes(
        Result(0.0, 0.0, np.array([1, 2], "<u8"), np.array([0, 0], "<u4"), np.ones(3, "<f4"))
    ),
    "counts that do not add up": lambda: work_with(counts=np.array([1, 1], "<u4")),
    "an empty item": lambda: work_with(lengths=np.array([0, 12, 1], "<i4")),
    "an empty item of many": lambda: long_work_with(lengths=np.array([0, 2] + [1] * 197, "<i4")),
    "an empty request of many": lambda: long_work_with(counts=np.array([101, 0] + [1] * 98, "<u4")),
    "counts of many that do not add up": lambda: long_work_with(counts=np.array([100, 2] + [1] * 98, "<u4")),
    "an unknown priority of many": lambda: long_work_with(priorities=np.array([0] * 99 + [2], "u1")),
    "deadlines that do not match the requests": lambda: work_with(deadlines=np.array([1.0], "<f8")),
    "priorities that do not match the requests": lambda: work_with(priorities=np.array([0], "u1")),
    "an unknown priority": lambda: work_with(priorities=np.array([0, 2], "u1")),
    "a latency sample without a priority": lambda: work_with(latencies=np.array([0.5], "<f8")),
    "a latency sample of an unknown priority": lambda: work_with(
        latencies=np.array([0.5], "<f8"), sample_priorities=np.array([7], "u1")
    ),
    "request ids that do not match the requests": lambda: work_with(request_ids=join_request_ids(["a"])),
    "not JSON": lambda: corrupt(frame_bytes(Hello(1, 0)), HEADER.size + 4, b"?"),
    "an unknown failure": lambda: frame_bytes(Errors([1], [EmbedError(Failure.INTERNAL, "x")])).replace(b",3,", b",9,"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
async def test_a_damaged_frame_is_a_protocol_error(damage: str) -> None:
    with pytest.raises(ProtocolError):
        await read_bytes(DAMAGE[damage]())


def test_versions_must_match() -> None:
    check_version(PROTOCOL_VERSION)
    with pytest.raises(ProtocolError, match="different kembed installs"):
        check_version(PROTOCOL_VERSION + 1)


def test_kinds_are_declared_once() -> None:
    assert sorted(m.kind for m in MESSAGES) == sorted(Kind)


def test_priorities_are_the_protos() -> None:
    """The classes cross the link as the values clients send: unset (0) is interactive."""
    from kembed.v1 import embedder_pb2 as pb

    assert {p.name: p.value for p in Priority} == {
        name.removeprefix("PRIORITY_"): value for name, value in pb.Priority.items()
    }
