"""What admission weighs a request against (a :class:`Load`): in the engine, its own measurements
(:class:`MeasuredLoad`: the service rate, a latency window per class and the shedding it drives);
in a front end, the same read off the board. The rules themselves are
:mod:`kembed.policy.admission`'s. Pure: the clock is injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from kembed.config.settings import Settings
from kembed.config.values import Admission
from kembed.policy.demand import CAPACITY_HOLD_TAUS, Capacity
from kembed.policy.priority import Priority

RATE_DECAY = 0.9  # weight of the past per completed batch in the service-rate estimate
RECOVER_FRACTION = 0.8  # shedding stops below this share of the soft P95 limit
MIN_LATENCY_SAMPLES = 5  # a P95 of fewer samples is noise
MAX_LATENCY_SAMPLES = 8192  # bounds the window's memory at high request rates
P95_CACHE_S = 0.05  # recompute the percentile at most this often


class ServiceRate:
    """Padded tokens per second of worker compute, weighted towards recent batches, and each batch
    weighted by its size against the largest (``full_tokens``): why, docs/decisions/admission.md."""

    def __init__(self, full_tokens: int = 0) -> None:
        self._full_tokens = full_tokens
        self._tokens = 0.0
        self._seconds = 0.0

    def seed(self, tokens: float, seconds: float) -> None:
        """Warmup's measurement (of full batches): stands in until real batches complete."""
        self._tokens, self._seconds = tokens, seconds

    def record(self, tokens: int, seconds: float) -> None:
        weight = min(1.0, tokens / self._full_tokens) if self._full_tokens > 0 else 1.0
        decay = RATE_DECAY**weight  # a full batch ages the past as much as it weighs
        self._tokens = self._tokens * decay + weight * tokens
        self._seconds = self._seconds * decay + weight * seconds

    @property
    def tokens_per_second(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else 0.0


class LatencyWindow:
    """Server-side latencies of the last ``window_s`` seconds, and their 95th percentile. Only the
    engine's event loop touches it (the board carries the percentile to everyone else).

    The samples are a preallocated ring of (time added, seconds), the newest overwriting the oldest
    past ``MAX_LATENCY_SAMPLES``: the P95 selects the window's part with one mask and partitions it,
    with no Python object per sample to walk: 25-30 µs a window of 4,500-8,192 samples on a 2-core
    EPYC, against 300-530 µs over a deque of tuples (docs/decisions/grpc-host-path.md)."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._window = window_s
        self._clock = clock
        self._added_at = np.empty(MAX_LATENCY_SAMPLES)
        self._seconds = np.empty(MAX_LATENCY_SAMPLES)
        self._count = 0  # samples ever added: the next goes to ``_count % MAX_LATENCY_SAMPLES``
        self._p95: float | None = None
        self._computed_at = -math.inf

    def add(self, seconds: float) -> None:
        # The cached P95 is not invalidated here: under overload every request adds a sample, and
        # recomputing per request cost more than the request itself.
        at = self._count % MAX_LATENCY_SAMPLES
        self._added_at[at] = self._clock()
        self._seconds[at] = seconds
        self._count += 1

    def p95(self) -> float | None:
        """None until there are enough recent samples to say anything."""
        now = self._clock()
        if now - self._computed_at < P95_CACHE_S:
            return self._p95
        held = min(self._count, MAX_LATENCY_SAMPLES)
        recent = self._seconds[:held][self._added_at[:held] >= now - self._window]
        self._p95 = None if recent.size < MIN_LATENCY_SAMPLES else percentile(recent, 95)
        self._computed_at = now
        return self._p95


def percentile(samples: np.ndarray, q: float) -> float:
    """``np.percentile(samples, q)`` to within rounding (its default: linear interpolation between
    the two closest ranks), by a partition around those two ranks alone: a sixth of the generic
    function's cost on the few thousand samples of a window."""
    rank = (samples.size - 1) * q / 100
    below = math.floor(rank)
    above = min(below + 1, samples.size - 1)
    ranked = np.partition(samples, (below, above))
    low, high = float(ranked[below]), float(ranked[above])
    return low + (high - low) * (rank - below)


class Load(Protocol):
    """What admission weighs a request against: measured in the engine, read off the board in a front end."""

    @property
    def tokens_per_second(self) -> float: ...

    def shed_fraction(self) -> float: ...

    def p95_seconds(self) -> float:
        """Interactive requests' P95, of served requests."""
        ...

    def add_refusal(self, spared_seconds: float, priority: Priority) -> None:
        """A refusal, at the wait it was spared: what shedding weighs besides served latency."""
        ...


class MeasuredLoad:
    """The engine's own measurements: the service rate, a latency window of served requests per
    class (exported), and the interactive window shedding acts on, with its hysteresis (batch work
    is there to wait)."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic, batch_tokens: int = 0) -> None:
        """``batch_tokens``: the most padded tokens a batch holds; each batch weighs in the rate
        as its share of it."""
        self._strategies = set(settings.admission)
        self._soft = settings.p95_soft_ms / 1000
        self._hard = settings.p95_hard_ms / 1000
        self.recover_below = self._soft * RECOVER_FRACTION
        self.rate = ServiceRate(batch_tokens)
        self._capacity = Capacity(settings.demand_window_s * CAPACITY_HOLD_TAUS)
        self._clock = clock
        self.latency = {priority: LatencyWindow(settings.latency_window_s, clock) for priority in Priority}
        # Served interactive requests and refusals at the wait they were spared.
        self.pressure = LatencyWindow(settings.latency_window_s, clock)
        self.shedding = False

    @property
    def tokens_per_second(self) -> float:
        return self.rate.tokens_per_second

    def capacity(self) -> float:
        """What the pod can serve, for the demand: the best rate measured, held (kembed/policy/demand.py)."""
        return self._capacity.update(self.rate.tokens_per_second, self._clock())

    def p95_seconds(self, priority: Priority = Priority.INTERACTIVE) -> float:
        """The class's P95 of served requests: what is exported."""
        return self.latency[priority].p95() or 0.0

    def add_latency(self, seconds: float, priority: Priority) -> None:
        """A served request's latency (answered, or timed out at its elapsed time)."""
        self.latency[priority].add(seconds)
        if priority is Priority.INTERACTIVE:
            self.pressure.add(seconds)

    def add_refusal(self, spared_seconds: float, priority: Priority) -> None:
        if priority is Priority.INTERACTIVE:
            self.pressure.add(spared_seconds)

    def shed_fraction(self) -> float:
        """Which share of requests the latency strategy rejects now (updates the hysteresis)."""
        if Admission.LATENCY not in self._strategies:
            return 0.0
        p95 = self.pressure.p95()
        if p95 is None:
            self.shedding = False
            return 0.0
        if p95 > self._soft:
            self.shedding = True
        elif p95 < self.recover_below:
            self.shedding = False
        if not self.shedding:
            return 0.0
        # Shedding rises linearly from the recovery floor to the hard limit, so once on it keeps
        # shedding a little until the P95 is back under the floor.
        if p95 >= self._hard:
            return 1.0
        return max(0.0, (p95 - self.recover_below) / (self._hard - self.recover_below))
