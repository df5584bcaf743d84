"""When a corpus run's stream may send again (:class:`Pacing`): after a refusal, when the server's
pushback says; after another failure, an exponential backoff, jittered; and when to give up, no
row having been written for ``give_up_s``. Pure: the clock and the jitter are injected.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kembed.client.corpus import CorpusError

BACKOFF_S = 0.1
MAX_BACKOFF_S = 10.0


@dataclass
class Pacing:
    """When the stream may send again, and when to give up. Pure: the clock and jitter are injected."""

    give_up_s: float
    clock: Callable[[], float] = time.monotonic
    jitter: Callable[[], float] = field(default=lambda: random.uniform(0.8, 1.2))
    paused_until: float = 0.0
    failures: int = 0  # in a row, for the backoff
    last_progress: float = field(init=False)

    def __post_init__(self) -> None:
        self.last_progress = self.clock()

    def wait_s(self) -> float:
        return max(0.0, self.paused_until - self.clock())

    def progressed(self) -> None:
        self.failures = 0
        self.last_progress = self.clock()

    def refused(self, retry_after_ms: int, why: str) -> None:
        """RESOURCE_EXHAUSTED: the server says when (already jittered); without a time, back off."""
        if not retry_after_ms:
            return self.failed(why)
        self._pause(retry_after_ms / 1000, why)

    def failed(self, why: str) -> None:
        self.failures += 1
        self._pause(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (self.failures - 1)) * self.jitter(), why)

    def _pause(self, seconds: float, why: str) -> None:
        now = self.clock()
        if now - self.last_progress > self.give_up_s:
            idle = now - self.last_progress
            raise CorpusError(f"gave up: no row written for {idle:.0f} s (--give-up-after); last: {why}")
        self.paused_until = max(self.paused_until, now + seconds)
