"""The units of work that flow down the request path: a Job per request, Chunks in buckets, Batches.

A request's items are routed into length buckets as Chunks (several items of one request that
share a bucket, kept together so nothing downstream loops per item). A Batch is a run of Chunks
from one bucket, shaped to a fixed (rows, seq_len). The Job collects its rows as batches finish.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Job:
    """One request's state from admission to its answer. Touched only on the event loop,
    except ``closed``, which the worker thread reads to skip abandoned work."""

    request_id: str
    token_counts: np.ndarray  # int32 [n]: real tokens per item
    padded_tokens: int  # what the request costs in its buckets (rows x bucket length)
    arrival: float  # monotonic seconds
    deadline: float  # monotonic seconds
    future: asyncio.Future[None]
    rows: np.ndarray  # float32 [n, model dimensions], filled as batches finish
    remaining: int = field(init=False)
    queued_tokens: int = 0  # of padded_tokens, how many still sit in the buckets
    inference_s: float = 0.0  # compute time of the batches its items ran in
    last_start: float = 0.0  # when the batch holding its last item started
    closed: bool = False  # answered, failed, timed out or cancelled: drop what is left

    def __post_init__(self) -> None:
        self.remaining = len(self.token_counts)

    @property
    def count(self) -> int:
        return len(self.token_counts)

    def close(self, error: BaseException | None = None) -> None:
        """Finish the job once: with its rows (error None) or with an error."""
        if self.closed:
            return
        self.closed = True
        if self.future.done():
            return
        if error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(error)

    def abandon(self) -> None:
        """Nobody waits any more (deadline, cancellation): what is left of the job is dropped."""
        self.closed = True
        self.future.cancel()


@dataclass(eq=False)
class Chunk:
    """Items of one job in one bucket: token ids right-padded to the bucket's length."""

    job: Job
    rows: np.ndarray  # int64 [k]: which of the job's items
    ids: np.ndarray  # int32 [k, bucket length]
    lengths: np.ndarray  # int32 [k]
    enqueued: float  # monotonic seconds

    @property
    def size(self) -> int:
        return len(self.rows)

    def split(self, n: int) -> tuple[Chunk, Chunk]:
        """The first ``n`` items and the rest (views, no copies)."""
        head = Chunk(self.job, self.rows[:n], self.ids[:n], self.lengths[:n], self.enqueued)
        tail = Chunk(self.job, self.rows[n:], self.ids[n:], self.lengths[n:], self.enqueued)
        return head, tail


@dataclass(eq=False)
class Batch:
    """Chunks from one bucket, computed together as one [rows, seq_len] tensor."""

    chunks: list[Chunk]
    seq_len: int  # padded sequence length the model sees
    rows: int  # batch rows including padding rows (a fixed shape when graphs are captured)

    @property
    def real_rows(self) -> int:
        return sum(chunk.size for chunk in self.chunks)

    @property
    def real_tokens(self) -> int:
        return int(sum(int(chunk.lengths.sum()) for chunk in self.chunks))

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.seq_len

    def assemble(self, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask as [rows, seq_len] arrays (one copy per chunk)."""
        ids = np.full((self.rows, self.seq_len), pad_id, dtype=np.int32)
        lengths = np.zeros(self.rows, dtype=np.int32)
        offset = 0
        for chunk in self.chunks:
            ids[offset : offset + chunk.size] = chunk.ids[:, : self.seq_len]
            lengths[offset : offset + chunk.size] = chunk.lengths
            offset += chunk.size
        mask = (np.arange(self.seq_len)[None, :] < lengths[:, None]).astype(np.int32)
        return ids, mask

    def live_chunks(self) -> list[Chunk]:
        """The chunks whose job still waits for them."""
        return [chunk for chunk in self.chunks if not chunk.job.closed]
