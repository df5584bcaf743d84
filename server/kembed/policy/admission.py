"""Admission control: reject early and cheaply instead of queueing into timeouts or OOM.

Two strategies, each optional, combined so that either one may reject:

- throughput: the longest wait the request may see behind the work ahead of it and its own (in
  padded tokens, over the measured service rate) must fit ``max_drain_ms``. The rate is an
  exponentially weighted ratio of tokens to wall seconds, recorded when batches *complete*; before
  the first batch it is seeded from warmup timings. The longest wait is a multiple of the drain
  time that depends on how queues drain (:attr:`kembed.policy.shapes.Queueing.wait_spread`). A request
  whose own wait alone is over the budget could never fit it: it is admitted once nothing of its
  class blocks it (below), since refusing it would refuse it for ever.
- latency: the P95 of interactive requests' server-side latency over a sliding window. Shedding
  acts on a window of served requests (answered, or timed out at their elapsed time) and of
  refusals at the wait they were spared: the drain time of the work ahead of them, never their own
  size, and at most the drain budget. So the P95 recovers as the backlog drains instead of locking
  shedding on, and a client cannot push it up by sending requests that are refused. The P95 that is
  exported (the autoscaler's metric, ``/health``) counts served requests alone. Shedding starts when
  the P95 passes the soft limit and stops only when it falls below ``RECOVER_FRACTION`` of it, so
  it does not flap; meanwhile the shed fraction rises linearly from that floor (0) to the hard
  limit (1). Shedding is work-conserving: a request whose longest wait is under the recovery floor
  is never shed, since refusing it cannot bring the P95 down and would only leave the worker idle.

Two classes (:class:`~kembed.policy.priority.Priority`). Interactive work is batched first, so what a
query waits behind is the interactive work queued and in the worker's hands: it is admitted
against that alone (:meth:`Backlog.ahead`), and a batch of ingest in the worker, which cannot be
preempted and which refusing the query would not shorten, never refuses it. Batch work is admitted
against everything. No single request may hold what the interactive class needs: an interactive
request whose own longest wait is over ``INTERACTIVE_SHARE`` of the budget is served as batch work
(:meth:`AdmissionController.class_of`), so queries go between its batches. Under pressure batch
work is refused first, with a pushback of its own; while shedding, every batch request that would
queue is refused, and an interactive one is never shed while batch work is queued or in the worker
(the ingest's batches, not the queries, are then what the P95 waits on). The queue cap counts
everything, but batch work none of whose items has started may be displaced (refused after
admission) to make room for an interactive request (:meth:`AdmissionController.room_to_make`), and
interactive work may go ``INTERACTIVE_RESERVE`` over the cap, so batch work that has started (an
ingest of the cap's size) never refuses a query.

Rejections carry a pushback: the time until the backlog ahead would have drained, jittered so
that clients refused together do not come back together (a pushback of just the excess brought
every closed-loop client back within milliseconds, a retry storm that cost more CPU than it served).

A hard cap on queued tokens bounds memory whatever the other settings are. Pure: the clock and
the random source are injected, so tests drive it with a fake clock.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kembed.config.settings import Settings
from kembed.config.values import Admission
from kembed.policy.load import RECOVER_FRACTION, Load
from kembed.policy.priority import Priority
from kembed.policy.shapes import Queueing

MAX_PUSHBACK_MS = 10_000
MIN_PUSHBACK_MS = 10
# An interactive request may hold at most this share of the interactive budget (its own longest
# wait over the drain budget); a larger one is served as batch work. Half, so that one request of
# that size still leaves room for the queries that arrive behind it.
INTERACTIVE_SHARE = 0.5
# Interactive work may go this share of the queue cap over it: batch work that has started cannot
# be displaced, and an ingest of the cap's size would otherwise refuse every query until its first
# batch completes.
INTERACTIVE_RESERVE = 0.125


@dataclass(frozen=True)
class Rejection:
    reason: str  # "drain_time", "latency_shed", "latency_hard", "queue_full", "displaced" or "deadline": the label
    retry_after_ms: int
    message: str


@dataclass(frozen=True)
class Backlog:
    """Padded tokens the engine holds, by where they are: what admission weighs a request against."""

    interactive: int = 0  # queued interactive work
    batch: int = 0  # queued batch work
    in_flight: int = 0  # in batches handed to the worker, every class
    displaceable: int = 0  # of ``batch``: requests none of whose items has started
    in_flight_interactive: int = 0  # of ``in_flight``: the rows of interactive items
    # Of the queued work, what will have expired before the worker could reach it (see ``lapsing``):
    # held in memory, but nobody waits behind it.
    interactive_lapsing: int = 0
    batch_lapsing: int = 0

    @property
    def total(self) -> int:
        return self.interactive + self.batch + self.in_flight

    def ahead(self, priority: Priority) -> int:
        """What the drain rule weighs a new request of this class against: for interactive work,
        the interactive work queued and in the worker (a batch of ingest in the worker delays a
        query by at most that batch, and refusing the query would not shorten it); batch work
        waits for everything."""
        if priority is Priority.INTERACTIVE:
            return self.interactive - self.interactive_lapsing + self.in_flight_interactive
        return self.total - self.interactive_lapsing - self.batch_lapsing

    def blocking(self, priority: Priority) -> int:
        """What keeps a request too large for the budget out: work of its own class, queued or in
        the worker (interactive work comes and goes in small requests and goes first anyway, so a
        steady flow of queries never keeps an ingest out)."""
        if priority is Priority.INTERACTIVE:
            return self.ahead(priority)
        return self.batch - self.batch_lapsing + self.in_flight - self.in_flight_interactive

    def held(self, priority: Priority) -> int:
        """What counts against the queue cap: an interactive request may displace batch work not started."""
        return self.total - self.displaceable if priority is Priority.INTERACTIVE else self.total

    def plus(self, tokens: int, priority: Priority) -> Backlog:
        """With a request admitted (not yet queued, so not displaceable). Built directly: this runs
        per admitted request, and ``dataclasses.replace`` costs several times more."""
        i, b, f, d, fi = self.interactive, self.batch, self.in_flight, self.displaceable, self.in_flight_interactive
        il, bl = self.interactive_lapsing, self.batch_lapsing
        if priority is Priority.INTERACTIVE:
            return Backlog(i + tokens, b, f, d, fi, il, bl)
        return Backlog(i, b + tokens, f, d, fi, il, bl)

    def with_lapsing(self, interactive: int, batch: int) -> Backlog:
        """With these parts of each class's queued work set apart as lapsing (built directly, as in
        ``plus``: this runs twice a frame and once a batch)."""
        i, b, f, d, fi = self.interactive, self.batch, self.in_flight, self.displaceable, self.in_flight_interactive
        return Backlog(i, b, f, d, fi, interactive, batch)

    def without_batch(self, tokens: int) -> Backlog:
        """With this much batch work not started displaced (it may have been what lapses)."""
        i, b, f, d, fi = self.interactive, self.batch, self.in_flight, self.displaceable, self.in_flight_interactive
        return Backlog(i, b - tokens, f, d - tokens, fi, self.interactive_lapsing, min(self.batch_lapsing, b - tokens))


def lapsing(queued_tokens: int, tokens_per_second: float, latest_deadline: float, now: float) -> int:
    """Of a class's queued tokens, those that will have expired before the worker could reach them:
    every job of the class is gone by its latest deadline, and the worker computes at most the
    rate's worth of tokens until then (fewer, with other work before them: so this is a lower
    bound). Work that expires in 6 s is weighed as 6 s of backlog, not as the minute it would take."""
    if tokens_per_second <= 0 or math.isinf(latest_deadline):
        return 0
    return max(0, queued_tokens - int(tokens_per_second * max(0.0, latest_deadline - now)))


class AdmissionController:
    """The rules, applied against a :class:`Load`: the engine's final word, or a front end's pre-screen."""

    def __init__(self, settings: Settings, load: Load, rng: random.Random | None = None) -> None:
        self._strategies = set(settings.admission)
        self._max_drain = settings.max_drain_ms / 1000
        self._soft = settings.p95_soft_ms / 1000
        self._recover_below = self._soft * RECOVER_FRACTION
        self._max_queued = settings.max_queued_tokens
        self._interactive_cap = settings.max_queued_tokens + int(settings.max_queued_tokens * INTERACTIVE_RESERVE)
        self._rng = rng or random.Random()
        self._wait_spread = Queueing.of(settings).wait_spread
        self.load = load

    def drain_seconds(self, backlog_tokens: int) -> float:
        """How long the backlog takes at the measured rate (0 when no rate is known yet)."""
        rate = self.load.tokens_per_second
        return backlog_tokens / rate if rate > 0 else 0.0

    def longest_wait(self, tokens_ahead: int) -> float:
        """The longest a request may wait behind ``tokens_ahead`` padded tokens (0 with no rate yet)."""
        return self._wait_spread * self.drain_seconds(tokens_ahead)

    def class_of(self, request_tokens: int, priority: Priority) -> Priority:
        """The class a request of this cost is served in: an interactive request whose own longest
        wait is over ``INTERACTIVE_SHARE`` of the drain budget goes as batch work, so that queries
        go between its batches instead of waiting behind all of it (or being refused for it)."""
        if priority is Priority.INTERACTIVE and self.longest_wait(request_tokens) > self._max_drain * INTERACTIVE_SHARE:
            return Priority.BATCH
        return priority

    def prescreen(self, min_tokens: int, backlog: Backlog, priority: Priority) -> Rejection | None:
        """Before tokenizing: the latency strategy's draw (it does not depend on the request's size)
        and the capacity checks against a lower bound of its cost, so overload is refused without
        spending CPU on tokenization. Rejections enter the class's shedding window."""
        rejection = self._shed(backlog.ahead(priority) + min_tokens, backlog, priority) or self._capacity(
            min_tokens, backlog, priority
        )
        return self._refused(rejection, backlog.ahead(priority), priority)

    def admit(self, request_tokens: int, backlog: Backlog, priority: Priority) -> Rejection | None:
        """After tokenizing: the capacity checks with the request's exact padded cost."""
        rejection = self._capacity(request_tokens, backlog, priority)
        return self._refused(rejection, backlog.ahead(priority), priority)

    def room_to_make(self, request_tokens: int, backlog: Backlog, priority: Priority) -> int:
        """Padded tokens of batch work not started that an admitted request must displace so that
        the queue stays within its cap (0 for batch work, which is admitted against the cap as is)."""
        if priority is not Priority.INTERACTIVE:
            return 0
        return max(0, backlog.total + request_tokens - self._max_queued)

    def in_time(
        self, request_tokens: int, backlog: Backlog, priority: Priority, seconds_left: float
    ) -> Rejection | None:
        """A call whose own deadline ends before the work ahead of it and its own would drain cannot
        make it: refused now, instead of queued to expire (a throughput rule)."""
        if Admission.THROUGHPUT not in self._strategies:
            return None
        tokens = backlog.ahead(priority) + request_tokens
        wait = self.drain_seconds(tokens)
        if wait <= seconds_left:
            return None
        message = (
            f"server is overloaded: estimated queue wait {wait * 1000:.0f} ms exceeds the call's "
            f"{seconds_left * 1000:.0f} ms deadline"
        )
        return Rejection("deadline", self.pushback(tokens), message)

    def beyond_deadline(self, request_tokens: int, seconds_left: float) -> Rejection | None:
        """The refusal of a call whose own work takes longer than its deadline, even alone (a
        throughput rule, as :meth:`in_time` is)."""
        if Admission.THROUGHPUT not in self._strategies:
            return None
        message = (
            f"the request's {request_tokens} padded tokens take longer than its "
            f"{seconds_left * 1000:.0f} ms deadline at this server's best rate: allow more time, or split it"
        )
        return Rejection("deadline", self.pushback(request_tokens), message)

    def displaced(self, request_tokens: int, backlog: Backlog) -> Rejection:
        """The refusal of batch work displaced from the queue: as if it arrived now, behind everything."""
        ahead = backlog.total + request_tokens
        message = "server queue is full: batch work not started gave its place to interactive work"
        return Rejection("displaced", self.pushback(ahead), message)

    def budget_tokens(self) -> int:
        """The padded tokens that an otherwise idle server admits at once, queued and computing, and
        neither rule refuses: the longest wait behind them, at the measured rate, within the drain
        budget, and with the latency rule under its recovery floor, where nothing is ever shed
        (whatever the P95); at most the queue cap. The cap alone before a rate is known, or with
        neither rule."""
        rate, waits = self.load.tokens_per_second, []
        if Admission.THROUGHPUT in self._strategies:
            waits.append(self._max_drain)
        if Admission.LATENCY in self._strategies:
            waits.append(self._recover_below)
        if not waits or rate <= 0:
            return self._max_queued
        return min(self._max_queued, int(rate * min(waits) / self._wait_spread))

    def saturation(self, backlog: Backlog) -> float:
        """The share of the admission budget the backlog fills, 0 to 1: the larger of the longest
        wait over the drain budget and the queued tokens over the cap. At 1 batch work is refused."""
        shares = [backlog.total / self._max_queued]
        if Admission.THROUGHPUT in self._strategies:
            shares.append(self.longest_wait(backlog.ahead(Priority.BATCH)) / self._max_drain)
        return min(1.0, max(shares))

    def _refused(self, rejection: Rejection | None, tokens_ahead: int, priority: Priority) -> Rejection | None:
        """A refusal enters the shedding window at the wait it spared: the drain time of the work
        ahead of it (its own size is no wait), at most the budget, so no request, however large, and
        no number of refusals can push the P95 past what the queue really holds."""
        if rejection is not None:
            self.load.add_refusal(min(self.drain_seconds(tokens_ahead), self._max_drain), priority)
        return rejection

    def _over_capacity(self, request_tokens: int, backlog: Backlog, priority: Priority) -> str | None:
        """Which capacity rule the request would break, if any."""
        if backlog.held(priority) + request_tokens > self._cap(priority):
            return "queue_full"
        if Admission.THROUGHPUT not in self._strategies:
            return None
        if self.longest_wait(request_tokens) > self._max_drain:
            # It could never fit the budget: refusing it for that would refuse it for ever, and with
            # nothing of its class ahead it starts at once.
            return "drain_time" if backlog.blocking(priority) else None
        return "drain_time" if self.longest_wait(backlog.ahead(priority) + request_tokens) > self._max_drain else None

    def _cap(self, priority: Priority) -> int:
        return self._interactive_cap if priority is Priority.INTERACTIVE else self._max_queued

    def _capacity(self, request_tokens: int, backlog: Backlog, priority: Priority) -> Rejection | None:
        reason = self._over_capacity(request_tokens, backlog, priority)
        if reason is None:
            return None
        ahead = backlog.ahead(priority) + request_tokens
        if reason == "queue_full":
            held, cap = backlog.held(priority), self._cap(priority)
            message = f"server queue is full ({held} of {cap} padded tokens queued)"
        else:
            message = (
                f"server is overloaded: estimated queue wait {self.longest_wait(ahead) * 1000:.0f} ms exceeds the "
                f"{self._max_drain * 1000:.0f} ms drain budget"
            )
        return Rejection(reason, self.pushback(ahead), message)

    def _shed(self, tokens_ahead: int, backlog: Backlog, priority: Priority) -> Rejection | None:
        """While shedding, every batch request that would queue goes first; an interactive one is
        shed by the fraction, and only while no batch work is queued or in the worker: beside an
        ingest, the ingest's batches are what queries wait on, and refusing queries would not
        shorten them (new batch work is refused instead)."""
        fraction = self.load.shed_fraction()
        if fraction <= 0 or self.longest_wait(tokens_ahead) < self._recover_below:
            return None
        beside_an_ingest = backlog.blocking(Priority.BATCH) > 0
        if priority is Priority.INTERACTIVE and (beside_an_ingest or self._rng.random() >= fraction):
            return None
        p95 = self.load.p95_seconds()
        return Rejection(
            "latency_hard" if fraction >= 1.0 else "latency_shed",
            self.pushback(tokens_ahead, floor_s=min(p95, MAX_PUSHBACK_MS / 1000)),
            f"server is shedding load: interactive p95 latency is over the {self._soft * 1000:.0f} ms limit",
        )

    def pushback(self, tokens_ahead: int, floor_s: float = 0.0) -> int:
        """Milliseconds until the backlog ahead would have drained, jittered by +-50%, within bounds."""
        seconds = max(self.drain_seconds(tokens_ahead), floor_s) * (0.5 + self._rng.random())
        return int(min(max(seconds * 1000, MIN_PUSHBACK_MS), MAX_PUSHBACK_MS))
