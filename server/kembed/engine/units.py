"""The units of work inside the engine (a Job per request, Chunks in buckets, Batches), and the
types its stages hand each other (a batch's :class:`Outcome` and :class:`Computed`, the way back
:class:`Replies`): a stage imports these, never another stage for a type, so the engine stays low.

Words used throughout the engine: an *item* is one text or sequence of a request; its *slot* is
its index within that request; a Chunk is a run of one request's items that share a bucket (kept
together so nothing downstream loops per item); a Batch is Chunks computed as one tensor of
``rows`` rows (padding rows included) by ``seq_len`` tokens. An item's *cost* is its length padded
to its bucket: the unit admission counts the backlog in, and the service rate is measured in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kembed.domain.errors import EmbedError
from kembed.ipc.protocol import Result
from kembed.policy.priority import Priority


@dataclass(eq=False)
class Job:
    """One request's state in the engine, from admission until its last item is computed. Touched
    only on the event loop, except ``closed``, which the worker thread reads to skip abandoned work;
    only :class:`~kembed.engine.jobs.Jobs` closes it."""

    link_id: int  # the front end it came from
    tag: int  # the front end's id for it
    count: int  # items
    deadline: float  # monotonic seconds (one clock for every process on the host)
    priority: Priority = Priority.INTERACTIVE
    remaining: int = field(init=False)
    queued_tokens: int = 0  # padded tokens of its items still in the buckets
    closed: bool = False  # computed, failed, timed out or cancelled: drop what is left

    def __post_init__(self) -> None:
        self.remaining = self.count


@dataclass(eq=False)
class Chunk:
    """Items of one job in one bucket: token ids right-padded to the bucket's length."""

    job: Job
    slots: np.ndarray  # int64 [k]: which of the job's items
    ids: np.ndarray  # int32 [k, bucket length]
    lengths: np.ndarray  # int32 [k]
    enqueued: float  # monotonic seconds

    @property
    def items(self) -> int:
        return len(self.slots)

    @property
    def cost(self) -> int:
        """Its items padded to its bucket."""
        return int(self.ids.size)

    def split(self, n: int) -> tuple[Chunk, Chunk]:
        """The first ``n`` items and the rest (views, no copies)."""
        head = Chunk(self.job, self.slots[:n], self.ids[:n], self.lengths[:n], self.enqueued)
        tail = Chunk(self.job, self.slots[n:], self.ids[n:], self.lengths[n:], self.enqueued)
        return head, tail

    def select(self, mask: np.ndarray) -> tuple[Chunk, Chunk]:
        """The items ``mask`` marks and the rest."""
        rest = ~mask
        chosen = Chunk(self.job, self.slots[mask], self.ids[mask], self.lengths[mask], self.enqueued)
        return chosen, Chunk(self.job, self.slots[rest], self.ids[rest], self.lengths[rest], self.enqueued)


@dataclass(eq=False)
class Batch:
    """Chunks computed together as one [rows, seq_len] tensor: from one bucket in a fixed shape, or
    packed from neighbouring buckets and padded to the longest item."""

    chunks: list[Chunk]
    seq_len: int  # padded sequence length the model sees
    rows: int  # padding rows included (a fixed shape when graphs are captured)

    @property
    def items(self) -> int:
        return sum(chunk.items for chunk in self.chunks)

    @property
    def real_tokens(self) -> int:
        return int(sum(int(chunk.lengths.sum()) for chunk in self.chunks))

    @property
    def padded_tokens(self) -> int:
        """What the model computes."""
        return self.rows * self.seq_len

    @property
    def cost(self) -> int:
        """What it took from the backlog."""
        return sum(chunk.cost for chunk in self.chunks)

    def assemble(self, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask as [rows, seq_len] arrays (one copy per chunk)."""
        ids = np.full((self.rows, self.seq_len), pad_id, dtype=np.int32)
        lengths = np.zeros(self.rows, dtype=np.int32)
        offset = 0
        for chunk in self.chunks:
            width = min(self.seq_len, chunk.ids.shape[1])  # a shorter bucket's chunk pads to the batch
            ids[offset : offset + chunk.items, :width] = chunk.ids[:, :width]
            lengths[offset : offset + chunk.items] = chunk.lengths
            offset += chunk.items
        mask = (np.arange(self.seq_len)[None, :] < lengths[:, None]).astype(np.int32)
        return ids, mask

    def live_chunks(self) -> list[Chunk]:
        """The chunks whose job still waits for them."""
        return [chunk for chunk in self.chunks if not chunk.job.closed]


@dataclass
class Outcome:
    """A run of chunks computed together: their rows, or the error that only they share."""

    chunks: list[Chunk]
    embeddings: np.ndarray | None  # float32 [items, dimensions], in the chunks' order
    error: BaseException | None
    padded_tokens: int
    real_tokens: int


@dataclass(frozen=True)
class Computed:
    """When and where a batch was computed: its lane, start and compute seconds."""

    lane: int
    started: float
    seconds: float


Deliver = Callable[[Batch, list[Outcome], Computed], None]


class Replies(Protocol):
    """The way back to the front ends."""

    def result(self, link_id: int, result: Result) -> None: ...

    def errors(self, link_id: int, tags: list[int], errors: list[EmbedError]) -> None: ...
