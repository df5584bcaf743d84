"""A front end's admission pre-screen: the engine's rules against the state the engine publishes.

Refusing here costs no tokenization and no trip to the engine, which is what keeps overload cheap.
The engine still has the final word (:mod:`kembed.engine.intake`): the board is at most one update
old, and every front end admits against the same backlog.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from kembed.admission import AdmissionController, Backlog, Rejection
from kembed.board import Board, Cell, ClassCell, FrontendCell
from kembed.config import Settings
from kembed.frontend.outbox import InTransit
from kembed.priority import Priority

Refusals = Callable[[float, Priority], None]  # where refusals' samples go: to the engine's shedding window


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
        self, settings: Settings, board: Board, frontend: int, in_transit: InTransit, refusals: Refusals
    ) -> None:
        """``frontend`` is this front end's index on the board; ``in_transit`` its work the engine
        has not taken yet."""
        self._board = board
        self._frontend = frontend
        self._in_transit = in_transit
        self._tokenizing = [0] * len(Priority)  # least costs of requests past the pre-screen, being tokenized
        self._admission = AdmissionController(settings, PublishedLoad(board, refusals))

    def class_of(self, padded_tokens: int, priority: Priority) -> Priority:
        """The class a request of this cost is served in (an interactive one too large for its
        share of the interactive budget goes as batch work)."""
        return self._admission.class_of(padded_tokens, priority)

    def before_tokenizing(self, least_padded_tokens: int, priority: Priority) -> Rejection | None:
        """The latency draw and the capacity checks on a lower bound of the request's cost."""
        return self._admission.prescreen(least_padded_tokens, self._backlog(), priority)

    @contextlib.contextmanager
    def tokenizing(self, least_padded_tokens: int, priority: Priority) -> Iterator[None]:
        """While a request that passed the pre-screen is tokenized (off the event loop, for a large
        one), its least cost counts as backlog: the calls of a burst behind it are screened against it."""
        self._tokenizing[priority] += least_padded_tokens
        try:
            yield
        finally:
            self._tokenizing[priority] -= least_padded_tokens

    def expected_wait(self, padded_tokens: int, priority: Priority) -> float:
        """How long a request of this cost and class waits now, its own work included, with the
        queue ahead of it served in order (the longest wait without its spread)."""
        return self._admission.drain_seconds(self._backlog().ahead(priority) + padded_tokens)

    def in_time(self, least_padded_tokens: int, priority: Priority, seconds_left: float) -> Rejection | None:
        """Whether a call with this much of its deadline left could be served before it ends."""
        return self._admission.in_time(least_padded_tokens, self._backlog(), priority, seconds_left)

    def longest_wait(self, padded_tokens: int, priority: Priority) -> float:
        """The longest a request of this cost and class may wait now, its own work included."""
        return self._admission.longest_wait(self._backlog().ahead(priority) + padded_tokens)

    def after_tokenizing(self, padded_tokens: int, priority: Priority) -> Rejection | None:
        """The capacity checks with the request's exact padded cost."""
        return self._admission.admit(padded_tokens, self._backlog(), priority)

    def _backlog(self) -> Backlog:
        """The engine's published backlog, plus this front end's work the engine has not taken yet:
        being tokenized, queued for the next frame, or in frames the engine has not acknowledged."""
        board = self._board
        taken = int(board.frontend(self._frontend, FrontendCell.FRAMES_TAKEN))
        mine = [
            sent + tokenizing
            for sent, tokenizing in zip(self._in_transit.unconfirmed(taken), self._tokenizing, strict=True)
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
