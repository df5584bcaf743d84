"""How much a client sends at once: the corpus command's stream (:mod:`.corpus.stream`) and the
library's ``embed`` (:mod:`.aio`) both keep these.

:class:`Budget` keeps a client's work out at once within what the server says it admits (gRPC
``Info.admission_budget_tokens``, read again every :data:`REFRESH_S` while it sends), so that a lone
client is never refused: it counts each text's padded tokens from its characters, at the tokens per
character the server's answers have shown. Beside other clients the server may still refuse; then
:class:`Window`, how many requests are out at once (AIMD with TCP's slow start), and
:class:`RequestSize`, how many texts one carries (halved when even a window of one or two is refused,
grown by a quarter on each answer of that size), pace it by the refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import grpc
import numpy as np

from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

# The share of the server's admission budget a client keeps out at once. Half: the server's rate may
# fall between two reads of it, and a text's tokens are estimated; at half, the longest wait behind
# the client's own work is half the drain budget, under the latency rule's recovery floor, and a
# part of at most half of it (below) is never served as ingest for its size.
BUDGET_SHARE = 0.5
# The most of the share one request carries, so that one is computing while the next is queued.
PART_SHARE = 0.5
LEARN_DECAY = 0.9  # the weight of what earlier answers showed of the tokens per character, per answer
REFRESH_S = 1.0  # how often a client that is sending reads the budget again (an Info call)
INFO_TIMEOUT_S = 10.0  # reading it again: past this, the last one read stands


class Window:
    """How many requests may be out at once: AIMD, with TCP's slow start. ``epoch`` counts the
    cuts, so that the requests refused together (sent before the cut) cut it once."""

    def __init__(self, largest: int) -> None:
        self.largest = largest
        self.limit = 1.0
        self.threshold = float(largest)
        self.epoch = 0

    def admits(self, in_flight: int) -> bool:
        return in_flight < int(self.limit)

    def refused(self, sent_in_epoch: int) -> None:
        if sent_in_epoch < self.epoch:
            return  # already cut for: it was on the wire before the cut
        self.threshold = max(1.0, self.limit / 2)
        self.limit = 1.0
        self.epoch += 1

    def succeeded(self) -> None:
        grown = self.limit + 1 if self.limit < self.threshold else self.limit + 1 / self.limit
        self.limit = min(float(self.largest), grown)


class RequestSize:
    """How many texts the next request carries, at most ``largest``; from ``start`` (default: ``largest``)."""

    def __init__(self, largest: int, start: int | None = None) -> None:
        self.largest = largest
        self.texts = largest if start is None else max(1, min(start, largest))

    def refused(self, texts: int) -> None:
        """Half of the refused request's size: requests refused together shrink it once, not each."""
        self.texts = min(self.texts, max(1, texts // 2))

    def succeeded(self, texts: int) -> None:
        if texts >= self.texts:
            self.texts = min(self.largest, self.texts + max(1, self.texts // 4))


class Budget:
    """The padded tokens of a client's requests out at once, kept within :data:`BUDGET_SHARE` of what
    the server admits (``Info.admission_budget_tokens``; 0: it does not say, and nothing is kept).
    A text's cost is its characters times the tokens per character the answers have shown, padded
    up to the server's bucket (a text over the model's limit: cut to it, or, ``chunked``, in chunks).
    Until an answer has shown that, a request goes alone. Used from one event loop, whose
    ``stub`` reads the budget again."""

    def __init__(
        self, info: pb.InfoResponse, stub: pb_grpc.EmbedderStub, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.tokens = int(info.admission_budget_tokens)
        self._stub = stub
        self._clock = clock
        self._read_at = clock()
        self._reading: asyncio.Future[None] | None = None
        limit = int(info.max_input_tokens) or max(info.buckets, default=0)
        self._buckets = np.asarray(sorted(set(info.buckets)) or [max(1, limit)], dtype=np.int64)
        self._limit = max(1, limit)
        self._chars = 0.0  # of the texts answered, the older weighing less (LEARN_DECAY an answer)
        self._answered_tokens = 0.0  # their token_counts, alike
        self.out = 0  # padded tokens of the requests out now

    def read_if_due(self) -> None:
        """Every :data:`REFRESH_S` while requests go out: the server's budget read again, not waited for."""
        if not self.tokens or self._clock() - self._read_at < REFRESH_S:
            return
        if self._reading is None or self._reading.done():
            self._read_at = self._clock()
            self._reading = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):  # the last one read stands; the requests say what went wrong
            self.tokens = int((await self._stub.Info(pb.InfoRequest(), timeout=INFO_TIMEOUT_S)).admission_budget_tokens)

    def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()

    @property
    def learned(self) -> bool:
        return self._chars > 0

    def costs(self, texts: Sequence[str], chunked: bool = False) -> np.ndarray:
        """Each text's estimated padded tokens (an empty one: none)."""
        chars = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        per_char = self._answered_tokens / self._chars if self._chars else 1.0
        tokens = np.ceil(chars * per_char).astype(np.int64)
        chunks = np.maximum(1, -(-tokens // self._limit)) if chunked else np.ones_like(tokens)
        each = np.minimum(-(-tokens // chunks), self._limit)  # a chunk's tokens, or the text cut to the limit
        at = np.minimum(np.searchsorted(self._buckets, each), len(self._buckets) - 1)
        return np.where(chars > 0, chunks * self._buckets[at], 0)

    def cost(self, texts: Sequence[str], chunked: bool = False) -> int:
        """A request's estimated padded tokens."""
        return int(self.costs(texts, chunked).sum())

    def fitting(self, texts: Sequence[str], chunked: bool = False) -> int:
        """How many of ``texts``, from the first, one request carries within its share (at least one;
        all of them while the server does not say, or no answer has shown a text's tokens yet)."""
        if not self.tokens or not self.learned:
            return len(texts)
        part = self.tokens * BUDGET_SHARE * PART_SHARE
        return max(1, int(np.searchsorted(np.cumsum(self.costs(texts, chunked)), part, side="right")))

    def admits(self, cost: int) -> bool:
        """Whether a request of ``cost`` may go now: alone, or within the share with those out."""
        return not self.tokens or not self.out or (self.learned and self.out + cost <= self.tokens * BUDGET_SHARE)

    def sent(self, cost: int) -> None:
        self.out += cost

    def settled(self, cost: int) -> None:
        """A request of ``cost`` was answered or failed."""
        self.out -= cost

    def answered(self, texts: Sequence[str], token_counts: Sequence[int]) -> None:
        """What an answer shows: these texts' tokens (their chunks' together)."""
        self._chars = self._chars * LEARN_DECAY + sum(map(len, texts))
        self._answered_tokens = self._answered_tokens * LEARN_DECAY + sum(token_counts)
