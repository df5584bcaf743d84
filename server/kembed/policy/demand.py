"""Offered demand: the work clients ask a pod for, admitted or refused, against what the pod can do.

``kembed_demand_ratio`` is the autoscaler's metric (docs/operator.md). Each front end counts the
padded tokens of every call it screens, once per call whatever the answer, into an exponentially
weighted rate (:class:`OfferedRate`), and keeps it on the board; the supervisor sums its front ends'
rates at scrape time, each decayed to the present, and divides by the pod's capacity (:func:`ratio`).
1.0 is a pod exactly at capacity; it goes past 1 under overload, since refused calls count too, so
unlike the drain time and the P95 it does not saturate where admission holds them.

The capacity is not the service rate of the moment (:class:`Capacity`): that rate falls in a lull,
whose one-text batches do less per token, and under overload, whose refusals take the cores from
the worker, so dividing by it read 0.69x at half load and 3.0x at twice the load (docs/operator.md).

A retry counts once: a call that says it is a retry (:func:`retry_attempt`) is not counted again,
wherever it lands. A client that retries without saying so is counted at every attempt. A marker
hides no work the pod does: a front end's demand is never below the work it admitted, retries
included. Nor is a call counted whose own work takes longer than its deadline at the capacity: no
pod could serve it.

Pure: the clock is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# The capacity forgets a best rate over this many of the demand's time constants (15 minutes at the
# default 15 s), so neither a lull nor an overload moves it within a scaling episode, and a lasting
# change (a slower mix of lengths, a busy node) still reaches it. At 20 (300 s) four minutes of
# overload took a quarter off it, and the gauge read 3.9 times its 1x value at 3x (bench.demand).
CAPACITY_HOLD_TAUS = 60.0


def decayed(rate: float, at: float, now: float, tau_s: float) -> float:
    """A rate last updated at ``at``, as it stands at ``now`` with no work offered since."""
    return rate * math.exp(-max(0.0, now - at) / tau_s)


class OfferedRate:
    """Work offered per second, exponentially weighted over ``tau_s`` (``KEMBED_DEMAND_WINDOW_S``):
    each offer adds its cost divided by the time constant, and the sum decays with it, so a steady
    flow of ``c`` per second reads ``c``, and the sum of several counters' rates is the rate of all
    their offers."""

    def __init__(self, tau_s: float, rate: float = 0.0, at: float = 0.0) -> None:
        self.tau_s = tau_s
        self.rate = rate
        self.at = at

    def add(self, cost: float, now: float) -> None:
        self.rate = self.at_time(now) + cost / self.tau_s
        self.at = now

    def at_time(self, now: float) -> float:
        """The rate as it stands at ``now``."""
        return decayed(self.rate, self.at, now, self.tau_s)


class Capacity:
    """The rate a pod can serve: the best service rate measured, forgotten over ``hold_s`` towards
    the rate of the moment. It rises at once when the pod shows it can do more (warmup seeds it);
    a lull or an overload lowers the measured rate for seconds to minutes and barely moves it."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.value = 0.0
        self.at: float | None = None

    def update(self, rate: float, now: float) -> float:
        if self.at is not None:  # the gap to the rate of the moment decays as an offered rate does
            self.value = rate + decayed(self.value - rate, self.at, now, self.hold_s)
        self.value, self.at = max(self.value, rate), now
        return self.value


def ratio(rates: Iterable[tuple[float, float]], now: float, capacity: float, tau_s: float) -> float:
    """The offered rate of every counter (``(rate, at)`` pairs), decayed to ``now``, over the rate
    the pod can serve (0 while it has none)."""
    if capacity <= 0:
        return 0.0
    return sum(decayed(rate, at, now, tau_s) for rate, at in rates) / capacity


def retry_attempt(marker: str | bytes | None) -> int:
    """A retry marker's value as the number of earlier attempts: 0 for none, or one that is not a
    whole number (a bad marker costs the client nothing but being counted again)."""
    if marker is None:
        return 0
    try:
        return max(0, int(marker))
    except ValueError:
        return 0
