"""One call's path through a front end, whatever edge it came in by, as the stages it runs:

    plan      what needs the model checked; its prompt; how its long inputs are chunked (preparing.py)
    screen    a lower bound of its cost (costing.py), weighed before it costs a tokenization: the
              first admission stage (screen.py)
    tokenize  its items: tokens, and chunks (preparing.py)
    admit     its exact cost (costing.py), weighed again: the second admission stage
    compute   submitted to the engine (link.py), awaited until its rows are in or its deadline passes
    answer    its rows combined, cut, normalised and encoded

Every edge hands it an :class:`~kembed.frontend.call.EmbedCall` (its limits checked while the edge
read it) and maps what it returns back. A refusal for load is a value, a
:class:`~kembed.frontend.pushback.Refusal`: the edge lets go of what the call holds, awaits its
pacing, then answers REJECTED with its pushback. Every other failure is a raised
:class:`~kembed.domain.errors.EmbedError`: bad input is INVALID_ARGUMENT (an ``InvalidInput`` that
locates it) before it can reach a shared batch; warming up or draining is UNAVAILABLE; work whose
deadline passed is dropped before compute and answered DEADLINE. Each edge maps them to its
transport's codes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from kembed import __version__
from kembed.config.settings import Settings
from kembed.domain.errors import EmbedError, Failure, Field, InvalidInput
from kembed.frontend.budget import MemoryBudget
from kembed.frontend.call import EmbedCall, EmbedResult, ServerInfo, Timings
from kembed.frontend.chunks import Chunks
from kembed.frontend.costing import Costing
from kembed.frontend.gate import Gate, warming_up
from kembed.frontend.inbox import Pending
from kembed.frontend.link import EngineLink
from kembed.frontend.preparing import Plan, Preparing
from kembed.frontend.pushback import PacedAnswers, Refusal
from kembed.frontend.quantize import encode
from kembed.frontend.screen import Screen, Waits
from kembed.metrics import FrontendMetrics
from kembed.plumbing.runtime import read_serving
from kembed.policy.admission import Rejection
from kembed.policy.priority import Priority

log = logging.getLogger(__name__)

_LEAST_NORM = np.float32(1e-12)  # a zero row stays zero


class Service(Protocol):
    """What the edges call: the real path once the engine is warm, a refusal before."""

    async def embed(self, call: EmbedCall) -> EmbedResult | Refusal: ...

    async def tokenize(self, call: EmbedCall) -> Chunks | Refusal: ...

    def info(self) -> ServerInfo: ...


class WarmingUp:
    """The service until the engine is warm: every call is UNAVAILABLE."""

    async def embed(self, call: EmbedCall) -> EmbedResult | Refusal:
        raise warming_up()

    async def tokenize(self, call: EmbedCall) -> Chunks | Refusal:
        raise warming_up()

    def info(self) -> ServerInfo:
        raise warming_up()


class Screened(NamedTuple):
    """A call past the first admission stage: its cost's lower bound, the bound the pre-screen
    weighed, its earlier attempts as demand counts them, and its class."""

    least: int
    bound: int
    attempt: int
    priority: Priority


class Admitted(NamedTuple):
    """A call past the second: its exact cost, its class, when it expires, and what it waits."""

    cost: int
    priority: Priority
    deadline: float
    waits: Waits


class EmbedService:
    """One call's stages, independent of the RPC shape (unary or stream)."""

    def __init__(
        self,
        settings: Settings,
        link: EngineLink,
        screen: Screen,
        gate: Gate,
        metrics: FrontendMetrics,
        executor: Executor,
        memory: MemoryBudget,
        paced: PacedAnswers,
        runtime: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._runtime = runtime  # where the engine says which forward serves
        self._settings = settings
        self._info = link.info
        self._link = link
        self._screen = screen
        self._gate = gate
        self._metrics = metrics
        self._memory = memory
        self._paced = paced
        self._clock = clock
        self._preparing = Preparing(settings, link.info, executor)
        self._costing = Costing(self._preparing.tokenizer, link.info.bucket_lengths, settings.max_items_per_request)

    async def embed(self, call: EmbedCall) -> EmbedResult | Refusal:
        """The call is admitted or refused as it arrives, never held. What it holds is weighed against
        the front end's memory budget from its arrival until it is answered or refused."""
        arrival = self._clock()
        self._gate.enter()
        try:
            plan = self._preparing.plan(call)
            with self._memory.reserve(self._preparing.weight(plan, self._info.dimensions)):
                return await self._serve(call, plan, arrival)
        finally:
            self._gate.leave()

    async def _serve(self, call: EmbedCall, plan: Plan, arrival: float) -> EmbedResult | Refusal:
        screened = self._screened(call, plan)
        if isinstance(screened, Refusal):
            return screened
        with self._screen.tokenizing(screened.bound, screened.priority):
            chunks = await self._preparing.tokenized(call, plan)
        tokenized = self._clock()
        admitted = self._admitted(call, chunks, screened, arrival, tokenized)
        if isinstance(admitted, Refusal):
            return admitted
        pending = await self._computed(chunks, admitted, arrival)
        return self._answer(call, chunks, pending, arrival, tokenized)

    async def tokenize(self, call: EmbedCall) -> Chunks | Refusal:
        """The call's inputs as :meth:`embed` would hand them to the engine (prompt, truncation,
        chunks, the same checks and limits), and no further: nothing is computed. It is screened as
        an embedding call of its cost is (its tokenizing takes the cores the compute does), weighed
        as work while it is tokenized, and not counted as demand."""
        self._gate.enter()
        try:
            plan = self._preparing.plan(call)
            screened = self._screened(call, plan, offered=False)
            if isinstance(screened, Refusal):
                return screened
            with (
                self._memory.reserve(self._preparing.weight(plan, 0)),
                self._screen.tokenizing(screened.bound, screened.priority),
            ):
                return await self._preparing.tokenized(call, plan)
        finally:
            self._gate.leave()

    def drain(self) -> None:
        """Answer every paced refusal now, and pace none from here on: a drain waits for no timer."""
        self._paced.drain()

    def _screened(self, call: EmbedCall, plan: Plan, offered: bool = True) -> Screened | Refusal:
        """The first admission stage, on a lower bound of the call's cost: what the server cannot
        take is refused before it costs a tokenization. A client whose refusals are being paced
        ignores its pushback: its bound is scaled to what calls have cost (``Costing.screened``),
        and its call is a retry in all but its marker (925 KB bodies re-sent at once read 133
        times the pod's capacity), counted as demand once, as any retry."""
        least = self._costing.least(call, plan)
        paced = self._paced.in_debt(call.peer)
        bound, attempt = self._costing.screened(least, paced), call.attempt or int(paced)
        priority = self._screen.class_of(bound, call.priority)
        if offered:
            rejection = self._screen.before_tokenizing(bound, priority, attempt, call.timeout_s)
        else:
            rejection = self._screen.before_tokenizing(bound, priority, offered=False)
        if rejection is not None:
            return self._refusal(rejection, priority, call.peer)
        return Screened(least, bound, attempt, priority)

    def _admitted(
        self, call: EmbedCall, chunks: Chunks, screened: Screened, arrival: float, tokenized: float
    ) -> Admitted | Refusal:
        """The second admission stage, at the call's exact cost, within its deadline: its own, or
        the server's default for a call that states none (:meth:`_default_budget`)."""
        cost = self._costing.exact(chunks.seqs.lengths, screened.least)
        if cost > (limit := self._settings.max_queued_tokens):
            reason = f"the request needs {cost} padded tokens, more than the server queues at once ({limit}): split it"
            raise InvalidInput(Field.INPUT, reason)
        priority = self._screen.class_of(cost, screened.priority)
        if priority is not call.priority:
            self._metrics.demoted.inc()
        stated = None if call.timeout_s is None else arrival + call.timeout_s
        left = None if stated is None else stated - tokenized
        waits = self._screen.after_tokenizing(cost, priority, screened.attempt, left)
        if isinstance(waits, Rejection):
            return self._refusal(waits, priority, call.peer)
        deadline = stated if stated is not None else arrival + self._default_budget(waits)
        return Admitted(cost, priority, deadline, waits)

    def _default_budget(self, waits: Waits) -> float:
        """The deadline of a call that states none: the server's default, or, for a request whose
        own work takes longer at the measured rate (an ingest of a thousand texts on a CPU), the
        longest it may wait for that work and what is ahead of it."""
        return max(self._settings.default_timeout_ms / 1000, waits.longest)

    def _refusal(self, rejection: Rejection, priority: Priority, client: str) -> Refusal:
        """The refusal, counted."""
        self._metrics.rejected.labels(reason=rejection.reason, priority=priority.label).inc()
        log.debug("refused (%s): %s", rejection.reason, rejection.message)
        error = EmbedError(Failure.REJECTED, rejection.message, rejection.retry_after_ms)
        return self._paced.refusal(client, error)

    async def _computed(self, chunks: Chunks, admitted: Admitted, arrival: float) -> Pending:
        """The call's items submitted to the engine, and its rows once they are in."""
        tag, pending = self._link.submit(chunks.seqs, admitted.cost, arrival, admitted.deadline, admitted.priority)
        await self._wait(tag, pending, admitted.deadline, admitted.waits.expected)
        return pending

    async def _wait(self, tag: int, pending: Pending, deadline: float, expected: float) -> None:
        """Until the rows are in. A call that expires, or whose client leaves, enters the P95 at no
        less than the wait it was admitted to (``expected``): short deadlines cannot pull the
        exported P95 below what served callers see."""
        # A timer on the loop rather than wait_for: no extra task or future per request.
        timer = asyncio.get_running_loop().call_at(deadline, self._expire, tag, pending, expected)
        try:
            await pending.future
        except asyncio.CancelledError:
            self._give_up(tag, pending, expected)
            raise
        finally:
            timer.cancel()

    def _expire(self, tag: int, pending: Pending, expected: float) -> None:
        """The deadline passed: the engine drops what is still queued, the caller hears why."""
        if pending.future.done():
            return
        self._give_up(tag, pending, expected)
        pending.future.set_exception(EmbedError(Failure.DEADLINE, "deadline passed before the request was computed"))

    def _give_up(self, tag: int, pending: Pending, expected: float) -> None:
        self._link.cancel(tag)
        self._link.add_latency(max(self._clock() - pending.arrival, expected), pending.priority)

    def _answer(
        self, call: EmbedCall, chunks: Chunks, pending: Pending, arrival: float, tokenized: float
    ) -> EmbedResult:
        """The rows as the call asked for them, its latency and stages counted."""
        done = self._clock()
        total_s, tokenize_s = done - arrival, tokenized - arrival
        self._link.add_latency(total_s, pending.priority)
        self._metrics.request_durations[pending.priority].observe(total_s)
        queue_s = max(0.0, pending.last_start - arrival - tokenize_s)
        self._metrics.stages(tokenize_s, queue_s, pending.inference_s)
        log.debug(
            "answered: %d items; tokenize %.1f ms, queue %.1f ms, compute %.1f ms, total %.1f ms",
            *(call.count, 1000 * tokenize_s, 1000 * queue_s, 1000 * pending.inference_s, 1000 * total_s),
        )
        vectors = postprocess(chunks.combine(pending.embeddings), call.dimensions, call.normalize)
        return EmbedResult(
            embeddings=encode(vectors, call.encoding),
            token_counts=chunks.token_counts(),
            request_id=call.request_id,
            timings=Timings(queue_s, tokenize_s, pending.inference_s, total_s),
            encoding=call.encoding,
            dimensions=vectors.shape[1],
        )

    def info(self) -> ServerInfo:
        settings = self._settings
        return ServerInfo(
            self._info,
            __version__,
            settings.max_items_per_request,
            settings.batching.value,
            settings.max_text_chars,
            settings.max_message_bytes,
            settings.served_model_name or self._info.model_id,
            settings.max_chunks_per_input,
            settings.chunk_long_inputs,
            read_serving(self._runtime).get("forward", ""),
            self._screen.budget_tokens(),
            settings.max_connection_age_ms,
            settings.connection_age_grace_ms,
        )


def postprocess(rows: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """Keep the first ``dimensions`` columns (0 = all), then L2-normalize if asked; zero rows stay zero."""
    if dimensions > rows.shape[1]:
        raise ValueError(f"dimensions {dimensions} exceeds the model's {rows.shape[1]}")
    kept = rows[:, :dimensions] if dimensions else rows
    if normalize:
        # np.linalg.norm's own sum, without its generic checks (a third of a one-row call's cost).
        norms = np.sqrt(np.add.reduce(kept * kept, axis=1, keepdims=True))
        kept = kept / np.maximum(norms, _LEAST_NORM)
    return np.ascontiguousarray(kept, dtype=np.float32)
