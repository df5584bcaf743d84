"""What a front end sends the engine: the next WORK frame, and the work in frames the engine has not
taken yet (which the pre-screen weighs, since the engine's published backlog cannot count it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kembed.domain.inputs import Sequences
from kembed.ipc.protocol import Work, join_request_ids
from kembed.policy.priority import Priority


class _Outgoing(NamedTuple):
    tag: int
    deadline: float
    cost: int
    priority: Priority
    lengths: np.ndarray
    ids: np.ndarray
    request_id: str


class NextFrame:
    """What the next WORK frame carries: requests, cancellations and latency samples."""

    def __init__(self) -> None:
        self._requests: list[_Outgoing] = []
        self._cancels: list[int] = []
        self._samples: list[tuple[float, Priority, bool]] = []  # seconds, class, refused

    def add(self, tag: int, seqs: Sequences, cost: int, deadline: float, priority: Priority, request_id: str) -> None:
        self._requests.append(_Outgoing(tag, deadline, cost, priority, seqs.lengths, seqs.ids, request_id))

    def cancel(self, tag: int) -> tuple[int, Priority] | None:
        """Nobody waits for ``tag``: a request still queued here is dropped (its cost and class
        returned), one already sent is cancelled in the engine by the next frame."""
        for i, request in enumerate(self._requests):
            if request.tag == tag:
                del self._requests[i]
                return request.cost, request.priority
        self._cancels.append(tag)
        return None

    def __bool__(self) -> bool:
        """Whether there is anything to send."""
        return bool(self._requests or self._cancels or self._samples)

    def add_latency(self, seconds: float, priority: Priority) -> None:
        """A served request's latency."""
        self._samples.append((seconds, priority, False))

    def add_refusal(self, spared_seconds: float, priority: Priority) -> None:
        """A refusal, at the wait it spared."""
        self._samples.append((spared_seconds, priority, True))

    @property
    def requests(self) -> int:
        return len(self._requests)

    def take(self) -> Work:
        """The frame, built from everything queued; the next one starts empty."""
        requests, self._requests = self._requests, []
        cancels, self._cancels = self._cancels, []
        samples, self._samples = self._samples, []
        tags, deadlines, costs, priorities, lengths, ids, names = zip(*requests, strict=True) if requests else ((),) * 7
        latencies, sample_priorities, refused = zip(*samples, strict=True) if samples else ((), (), ())
        return Work(
            tags=np.asarray(tags, dtype="<u8"),
            deadlines=np.asarray(deadlines, dtype="<f8"),
            counts=np.fromiter(map(len, lengths), dtype="<u4", count=len(lengths)),
            costs=np.asarray(costs, dtype="<u8"),
            priorities=np.asarray(priorities, dtype="u1"),
            lengths=_concat(lengths),
            ids=_concat(ids),
            cancels=np.asarray(cancels, dtype="<u8"),
            latencies=np.asarray(latencies, dtype="<f8"),
            sample_priorities=np.asarray(sample_priorities, dtype="u1"),
            sample_refused=np.asarray(refused, dtype="u1"),
            request_ids=join_request_ids(names),
        )


class InTransit:
    """Padded tokens by class of requests submitted here that the engine's published backlog may
    not count yet: queued for the next frame, or in frames past the number it has acknowledged
    taking. The pre-screen weighs them too: a burst read in one loop turn would otherwise be
    admitted, request after request, against a board that has not seen any of it. ``frames_taken``
    reads the engine's acknowledgement: how many of this front end's frames it has taken."""

    def __init__(self, frames_taken: Callable[[], int]) -> None:
        self._frames_taken = frames_taken
        self._queued = [0] * len(Priority)  # for the next frame
        self._frames_sent = 0
        self._sent: deque[tuple[int, list[int]]] = deque()  # (frame number, tokens by class)
        self._untaken = [0] * len(Priority)  # in frames sent, not yet taken

    def engine_behind(self) -> bool:
        """Whether the engine has yet to take a frame sent."""
        return self._frames_taken() < self._frames_sent

    def queued(self, cost: int, priority: Priority) -> None:
        self._queued[priority] += cost

    def withdrawn(self, cost: int, priority: Priority) -> None:
        """A queued request was dropped before its frame went."""
        self._queued[priority] -= cost

    def frame_sent(self) -> None:
        """A WORK frame went, carrying everything queued."""
        self._frames_sent += 1
        if any(self._queued):
            self._sent.append((self._frames_sent, self._queued))
            self._untaken = [sent + queued for sent, queued in zip(self._untaken, self._queued, strict=True)]
            self._queued = [0] * len(Priority)

    def unconfirmed(self) -> list[int]:
        """Padded tokens by class that the engine's published backlog does not count yet."""
        frames_taken = self._frames_taken()
        while self._sent and self._sent[0][0] <= frames_taken:
            for priority, tokens in enumerate(self._sent.popleft()[1]):
                self._untaken[priority] -= tokens
        return [sent + queued for sent, queued in zip(self._untaken, self._queued, strict=True)]


def _concat(arrays: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.concatenate(arrays).astype("<i4", copy=False) if arrays else np.empty(0, dtype="<i4")
