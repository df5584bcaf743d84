"""A front end's admission pre-screen: the engine's rules against the state the engine publishes.

Refusing here costs no tokenization and no trip to the engine, which is what keeps overload cheap.
The engine still has the final word (:mod:`kembed.engine.intake`): the board is at most one update
old, and every front end admits against the same backlog.

The screen also counts the work offered (:mod:`kembed.policy.demand`), once per call at the step that
decides it: a call refused before tokenizing at the lower bound of its cost the pre-screen weighed,
any other at its exact padded cost, admitted or refused. A retry (``attempt`` over 0) is not
counted again. Calls refused before the screen (bad input, warming up, draining, the front end's
memory budget) are not work the pod could have done, and are not counted; nor is a call whose own
work takes longer than its deadline at the pod's capacity: no pod could do it in time (a client
once moved the gauge from 0 to 784 with such calls). A retry marker cannot hide work the pod does:
the demand published is never below the work admitted, retries included, over the same window.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from kembed.config.settings import Settings
from kembed.frontend.outbox import InTransit
from kembed.ipc.board import Board, Cell, ClassCell, FrontendCell
from kembed.policy.admission import AdmissionController, Backlog, Rejection
from kembed.policy.demand import OfferedRate
from kembed.policy.priority import Priority

Refusals = Callable[[float, Priority], None]  # where refusals' samples go: to the engine's shedding window


class Waits(NamedTuple):
    """What an admitted request waits now, its own work included, with the queue ahead of it served
    in order: ``expected`` (without the buckets' spread), and the ``longest``."""

    expected: float
    longest: float


class PublishedLoad:
    """The engine's measurements, read off the board; refusals' samples travel to the engine."""

    def __init__(self, board: Board, refusals: Refusals) -> None:
        self._board = board
        self._refusals = refusals

    @property
    def tokens_per_second(self) -> float:
        return self._board[Cell.TOKENS_PER_SECOND]

    def shed_fraction(self) -> float:
        return self._board[Cell.SHED_FRACTION]

    def p95_seconds(self) -> float:
        return self._board.of_class(Priority.INTERACTIVE, ClassCell.P95_SECONDS)

    def add_refusal(self, spared_seconds: float, priority: Priority) -> None:
        self._refusals(spared_seconds, priority)


class Screen:
    def __init__(
        self,
        settings: Settings,
        board: Board,
        frontend: int,
        in_transit: InTransit,
        refusals: Refusals,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``frontend`` is this front end's index on the board; ``in_transit`` its work the engine
        has not taken yet."""
        self._board = board
        self._frontend = frontend
        self._in_transit = in_transit
        self._tokenizing = [0] * len(Priority)  # least costs of requests past the pre-screen, being tokenized
        self._admission = AdmissionController(settings, PublishedLoad(board, refusals))
        self._clock = clock
        # Carried on from the board: a front end restarted in a running pod keeps its predecessor's rate.
        rate, at = (
            board.frontend(frontend, FrontendCell.OFFERED_RATE),
            board.frontend(frontend, FrontendCell.OFFERED_AT),
        )
        self._offered = OfferedRate(settings.demand_window_s, rate, at)
        self._admitted = OfferedRate(settings.demand_window_s, rate, at)  # what admission let through

    def class_of(self, padded_tokens: int, priority: Priority) -> Priority:
        """The class a request of this cost is served in (an interactive one too large for its
        share of the interactive budget goes as batch work)."""
        return self._admission.class_of(padded_tokens, priority)

    def budget_tokens(self) -> int:
        """What the engine admits at once now, on an otherwise idle server (what gRPC ``Info`` tells)."""
        return self._admission.budget_tokens()

    def before_tokenizing(
        self,
        least_padded_tokens: int,
        priority: Priority,
        attempt: int = 0,
        seconds_left: float | None = None,
        offered: bool = True,
    ) -> Rejection | None:
        """The latency draw and the capacity checks on a lower bound of the request's cost, and, for
        a call with ``seconds_left`` of its deadline, whether it could be served before it ends
        (counted as offered when refused, unless not ``offered``: a call that asks for no
        compute). One read of the backlog for both."""
        backlog = self._backlog()
        rejection = self._admission.prescreen(least_padded_tokens, backlog, priority)
        if rejection is None and seconds_left is not None:
            rejection = self._admission.in_time(least_padded_tokens, backlog, priority, seconds_left)
        if rejection is not None and offered and self._could_serve(least_padded_tokens, seconds_left):
            self.offer(least_padded_tokens, attempt)
        return rejection

    @contextlib.contextmanager
    def tokenizing(self, least_padded_tokens: int, priority: Priority) -> Iterator[None]:
        """While a request that passed the pre-screen is tokenized (off the event loop, for a large
        one), its least cost counts as backlog: the calls of a burst behind it are screened against it."""
        self._tokenizing[priority] += least_padded_tokens
        try:
            yield
        finally:
            self._tokenizing[priority] -= least_padded_tokens

    def after_tokenizing(
        self, padded_tokens: int, priority: Priority, attempt: int = 0, seconds_left: float | None = None
    ) -> Rejection | Waits:
        """The capacity checks with the request's exact padded cost, counted as offered: its
        refusal, or the waits it was admitted to (one read of the backlog for both). A call with
        ``seconds_left`` of its deadline whose own work takes longer at the pod's capacity is
        refused, and not counted: no pod could serve it in time."""
        if not self._could_serve(padded_tokens, seconds_left):
            late = self._admission.beyond_deadline(padded_tokens, seconds_left or 0.0)
            if late is not None:
                return late
        self.offer(padded_tokens, attempt)
        backlog = self._backlog()
        rejection = self._admission.admit(padded_tokens, backlog, priority)
        if rejection is not None:
            return rejection
        self._admit(padded_tokens)
        ahead = backlog.ahead(priority) + padded_tokens
        return Waits(self._admission.drain_seconds(ahead), self._admission.longest_wait(ahead))

    def offer(self, padded_tokens: int, attempt: int) -> None:
        """Count a call's work as offered, unless it is a retry (counted at its first attempt)."""
        if attempt:
            return
        now = self._clock()
        self._offered.add(padded_tokens, now)
        self._publish(now)

    def _admit(self, padded_tokens: int) -> None:
        """Count an admitted call's work, a retry's too: the demand is never below it."""
        now = self._clock()
        self._admitted.add(padded_tokens, now)
        self._publish(now)

    def _publish(self, now: float) -> None:
        """The demand: the work offered, or the work admitted if more (retries marked as such that
        the pod serves). Both decay alike, so their larger one decays as one rate."""
        rate = max(self._offered.at_time(now), self._admitted.at_time(now))
        self._board.set_frontend(self._frontend, FrontendCell.OFFERED_RATE, rate)
        self._board.set_frontend(self._frontend, FrontendCell.OFFERED_AT, now)

    def _could_serve(self, padded_tokens: int, seconds_left: float | None) -> bool:
        """Whether a pod could serve a call of this cost within ``seconds_left`` (None: no deadline)
        at the best rate this one has shown (its capacity; any, while it has none)."""
        capacity = self._board[Cell.CAPACITY]
        return seconds_left is None or capacity <= 0 or padded_tokens <= capacity * seconds_left

    def _backlog(self) -> Backlog:
        """The engine's published backlog, plus this front end's work the engine has not taken yet:
        being tokenized, queued for the next frame, or in frames the engine has not acknowledged."""
        board = self._board
        mine = [
            sent + tokenizing for sent, tokenizing in zip(self._in_transit.unconfirmed(), self._tokenizing, strict=True)
        ]
        return Backlog(
            interactive=int(board.of_class(Priority.INTERACTIVE, ClassCell.QUEUED_TOKENS)) + mine[Priority.INTERACTIVE],
            batch=int(board.of_class(Priority.BATCH, ClassCell.QUEUED_TOKENS)) + mine[Priority.BATCH],
            in_flight=int(board[Cell.IN_FLIGHT_TOKENS]),
            displaceable=int(board[Cell.DISPLACEABLE_TOKENS]),
            in_flight_interactive=int(board[Cell.IN_FLIGHT_INTERACTIVE_TOKENS]),
            interactive_lapsing=int(board.of_class(Priority.INTERACTIVE, ClassCell.LAPSING_TOKENS)),
            batch_lapsing=int(board.of_class(Priority.BATCH, ClassCell.LAPSING_TOKENS)),
        )
