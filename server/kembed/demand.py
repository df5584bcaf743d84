"""Offered demand: the work clients ask a pod for, admitted or refused, against what the pod can do.

``kembed_demand_ratio`` is the autoscaler's metric (docs/operator.md). Each front end counts the
padded tokens of every call it screens, once per call whatever the answer, into an exponentially
weighted rate (:class:`OfferedRate`), and keeps it on the board; the supervisor sums its front ends'
rates at scrape time, each decayed to the present, and divides by the engine's measured service
rate (:func:`ratio`). 1.0 is a pod exactly at capacity; it goes past 1 under overload, since refused
calls count too, so unlike the drain time and the P95 it does not saturate where admission holds them.

A retry counts once: a call that says it is a retry (:func:`retry_attempt`) is not counted again,
wherever it lands. A client that retries without saying so is counted at every attempt.

Pure: the clock is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# The rate's time constant: an exponentially weighted rate over this many seconds is as noisy as a
# plain count over twice as many (30 s), two syncs of the HPA, and reaches 63% of a step in one sync.
DEMAND_TAU_S = 15.0


def decayed(rate: float, at: float, now: float) -> float:
    """A rate last updated at ``at``, as it stands at ``now`` with no work offered since."""
    return rate * math.exp(-max(0.0, now - at) / DEMAND_TAU_S)


class OfferedRate:
    """Work offered per second, exponentially weighted over :data:`DEMAND_TAU_S`: each offer adds
    its cost divided by the time constant, and the sum decays with it, so a steady flow of ``c``
    per second reads ``c``, and the sum of several counters' rates is the rate of all their offers."""

    def __init__(self, rate: float = 0.0, at: float = 0.0) -> None:
        self.rate = rate
        self.at = at

    def add(self, cost: float, now: float) -> None:
        self.rate = decayed(self.rate, self.at, now) + cost / DEMAND_TAU_S
        self.at = now


def ratio(rates: Iterable[tuple[float, float]], now: float, capacity: float) -> float:
    """The offered rate of every counter (``(rate, at)`` pairs), decayed to ``now``, over the rate
    the pod can serve (0 while it has none)."""
    if capacity <= 0:
        return 0.0
    return sum(decayed(rate, at, now) for rate, at in rates) / capacity


def retry_attempt(marker: str | bytes | None) -> int:
    """A retry marker's value as the number of earlier attempts: 0 for none, or one that is not a
    whole number (a bad marker costs the client nothing but being counted again)."""
    if marker is None:
        return 0
    try:
        return max(0, int(marker))
    except ValueError:
        return 0
