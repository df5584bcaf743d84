"""Whether the pod refuses now: the refusals its edges answered in the last ``WINDOW_S``, for
``/health`` (``saturated``). Refusals leave nothing on the board (a refused call never queues), so a
burst refused whole looks, a moment later, like an idle pod; the edges' own answer counters say
otherwise. The supervisor samples them every ``SAMPLE_S`` and once more when ``/health`` asks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from prometheus_client import CollectorRegistry

from kembed.contract import Metric

WINDOW_S = 10.0
SAMPLE_S = 1.0
REFUSED_CODES = frozenset({"RESOURCE_EXHAUSTED", "429"})  # gRPC's, REST's: whatever refused it


class Answers(NamedTuple):
    """The answers counted since the pod started: all of them, and the refusals among them."""

    answered: float
    refused: float


def counted(registry: CollectorRegistry) -> Answers:
    """``kembed_requests_total`` read off the registry: every answer, and the refusals."""
    answered = refused = 0.0
    for family in registry.collect():
        if family.name != Metric.REQUESTS:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                answered += sample.value
                refused += sample.value if sample.labels.get("code") in REFUSED_CODES else 0.0
    return Answers(answered, refused)


class RecentRefusals:
    """The answers and refusals of the last :data:`WINDOW_S`, from samples of the running totals."""

    def __init__(self, read: Callable[[], Answers], clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self._clock = clock
        self._samples: deque[tuple[float, Answers]] = deque()

    def sample(self) -> Answers:
        """Read the totals now; keep what the window needs, and the sample just before it."""
        now, totals = self._clock(), self._read()
        self._samples.append((now, totals))
        while len(self._samples) > 1 and self._samples[1][0] <= now - WINDOW_S:
            self._samples.popleft()
        return totals

    def recent(self) -> Answers:
        """What was answered and refused within the window (since the first sample, if younger)."""
        now = self.sample()
        then = self._samples[0][1]
        return Answers(now.answered - then.answered, now.refused - then.refused)
