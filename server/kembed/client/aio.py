"""The library's one core, on asyncio (grpc.aio): :class:`AsyncEmbedClient`. The blocking
:class:`~kembed.client.EmbedClient` drives it on a private event loop.

``embed`` takes any number of texts. It cuts them into parts within the server's limits (read once
from ``Info``: texts per request, message size; :mod:`.requests`) and sends them paced by what the
server says, as the corpus command paces its stream (:mod:`.window`):

- the padded tokens of its parts out at once within half of what the server admits
  (``Info.admission_budget_tokens``, read again every second while it sends), each part at most a
  quarter of it, a text's tokens estimated from its characters at the rate the answers have shown
  (:class:`~kembed.client.window.Budget`): a lone client on an idle server is never refused;
- a window of parts out at once, from one, grown by each answer and cut to one by a refusal of a
  part sent while others of the client's were out: the server had room for those, so the window
  was too wide (so is one just after an answer of ours: :data:`ECHO_S`). Such a refusal is not a
  retry and spends nothing of the :class:`RetryBudget`; the part goes again once the window has
  room (held at most :data:`ECHO_S`, so that an echo is not refused again at once);
- the texts a part carries, from :data:`START_TEXTS`, grown by a quarter on each answer of that
  size and halved when a window of two parts is refused (or one, by the server's overload): a part
  must fit the server's drain budget by itself, with room for the next one;
- a refusal of a part that was out alone is the server's overload, not the client's: it is retried
  after the pushback, which holds every part of the client, and spends the budget
  (:class:`~kembed.client.retries.Retrying`).

Parts are answered in any order and joined in input order. ``timeout_s`` is one deadline for a
whole call: each attempt gets what is left, and a pushback longer than that ends the call at once.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np

from kembed.client.connection import MAX_MESSAGE_BYTES, Connection
from kembed.client.errors import EmbedError, InvalidInput, Unavailable, check_texts, embed_error
from kembed.client.requests import Limits, Options, Part, Prompt, decode, plan
from kembed.client.retries import Deadline, RetryBudget, Retrying
from kembed.client.window import Budget, RequestSize, Window
from kembed.contract import RETRY_ATTEMPT_KEY
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

T = TypeVar("T")

IN_FLIGHT = 8  # the most parts of one client out at once: the window's ceiling
START_TEXTS = 64  # a first part's texts: small enough for any server's budget, grown on answers
BLOCKED_POLL_S = 0.01  # a call whose window is filled by another call of the client looks again after
# A refusal of a part sent this soon after an answer of ours may still count that answered part: a
# front end weighs the engine's backlog as it last read it, a moment late.
ECHO_S = 0.5


@dataclass(frozen=True)
class Flight:
    """A part on its way: the window's epoch and how many other parts of the client were out when
    it was sent (``echo``: one was answered just before), its attempt (1: the first; what the retry
    budget counts) and how often its texts were sent before (a refusal of our own window is no retry,
    but the server was offered that work already)."""

    part: Part
    epoch: int
    beside: int
    echo: bool
    attempt: int
    sent: int
    cost: int  # its padded tokens, as the budget estimated them


# A call's parts not out, as (first text's index, attempt, earlier sends, part): a heap, so the
# earliest goes first.
Waiting = list[tuple[int, int, int, Part]]


class AsyncEmbedClient:
    """``async with AsyncEmbedClient("host:50051") as client: await client.embed([...])``, or
    ``AsyncEmbedClient(Connection(...))``; the keyword arguments ``ca_file``, ``cert_file``,
    ``key_file``, ``api_key``, ``round_robin`` and ``max_message_bytes`` build the :class:`Connection` for a target
    given as a string. ``timeout_s`` is each call's deadline, its retries and waits included (None:
    none; an attempt then gets at most 300 s); ``in_flight`` the most parts out at once. Use it from
    one event loop. Failures are :class:`~kembed.client.EmbedError`."""

    def __init__(
        self,
        target: str | Connection,
        *,
        timeout_s: float | None = None,
        max_attempts: int = 6,
        backoff_s: float = 0.1,
        in_flight: int = IN_FLIGHT,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        round_robin: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        api_key: str | None = None,
        retry_budget: RetryBudget | None = None,
    ) -> None:
        if isinstance(target, str):
            target = Connection(target, ca_file, cert_file, key_file, max_message_bytes, round_robin, api_key=api_key)
        self.connection = target
        self._channel = target.aio_channel()
        self._stub = pb_grpc.EmbedderStub(self._channel)
        self._timeout = timeout_s
        self.retry_budget = retry_budget or RetryBudget()
        self._retrying = Retrying(self.retry_budget, max_attempts, backoff_s)
        self._window = Window(in_flight)
        self._out = 0  # parts of every call of this client out now
        self._answered_at = -ECHO_S  # monotonic: the latest answer to a part
        self._limits: Limits | None = None  # the server's, read from Info at the first embed
        self._size: RequestSize | None = None  # with the limits
        self._budget: Budget | None = None  # with the limits, read again while sending
        self.refusals = 0  # RESOURCE_EXHAUSTED answers, retried or not

    @property
    def retries(self) -> int:
        """How many attempts were retried, for callers that want to know."""
        return self._retrying.retries

    async def embed(
        self,
        texts: Sequence[str],
        *,
        normalize: bool = True,
        dimensions: int = 0,
        truncate: bool = False,
        priority: str = "interactive",
        chunk: bool | None = None,
        prompt_name: str = "",
        prompt: str | None = None,
        input_type: str = "",
        encoding: str = "float32",
        truncation_direction: str = "right",
    ) -> np.ndarray:
        """Any number of texts (non-empty strings), in parts within the server's limits, paced by
        its refusals, answered in order as float32 ``[len(texts), dimensions]`` (``encoding``: int8,
        uint8, binary or ubinary, quantized by the server as docs/api.md says). ``priority`` is
        ``"interactive"`` (a caller waits) or ``"batch"`` (an ingest, which queries go ahead of);
        ``truncate`` cuts a text over the model's limit to its start, or with
        ``truncation_direction="left"`` to its end (a prompt stays at its head);
        ``chunk=True`` embeds a text longer than the model's limit as chunks (None: the server's
        default). At most one of ``prompt_name`` (one of the model's prompts), ``prompt`` (its text;
        ``""``: none) and ``input_type`` (query, passage or document); none: the model's default."""
        check_texts(texts)
        deadline = Deadline.after(self._timeout)
        chosen = Prompt(prompt_name, prompt, input_type)
        options = Options(normalize, dimensions, truncate, priority, chunk, chosen, encoding, truncation_direction)
        limits = await self._read_limits(deadline)
        try:
            parts = plan(texts, options, limits)
        except ValueError as error:  # an option the server does not take (the priority's label)
            raise InvalidInput(str(error)) from None
        rows = await self._send(parts, deadline, limits.chunked(options))
        return np.concatenate([rows[first] for first in sorted(rows)])

    async def embed_tokens(
        self, sequences: Sequence[Sequence[int]], *, normalize: bool = True, dimensions: int = 0
    ) -> np.ndarray:
        """Pre-tokenized input (ids including the model's special tokens), as one request."""
        return decode(await self.embed_request(tokens_request(sequences, normalize, dimensions)))

    async def embed_request(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        """One request as it is, retried politely."""
        answer: pb.EmbedResponse = await self._call(self._stub.Embed, request, Deadline.after(self._timeout))
        return answer

    async def info(self) -> pb.InfoResponse:
        return await self._info(Deadline.after(self._timeout))

    async def limits(self) -> Limits:
        """What one request may carry: the server's limits, read once."""
        return await self._read_limits(Deadline.after(self._timeout))

    async def _info(self, deadline: Deadline) -> pb.InfoResponse:
        answer: pb.InfoResponse = await self._call(self._stub.Info, pb.InfoRequest(), deadline)
        return answer

    async def _read_limits(self, deadline: Deadline) -> Limits:
        if self._limits is None:
            info = await self._info(deadline)
            self._limits = Limits.of(self.connection, info)
            self._size = RequestSize(max(1, self._limits.items or START_TEXTS), START_TEXTS)
            self._budget = Budget(info, self._stub)
        return self._limits

    async def _send(self, parts: list[Part], deadline: Deadline, chunked: bool) -> dict[int, np.ndarray]:
        """Every part's rows, by its first text's index: sent as the window and the pushback allow,
        a refused part sent again (cut to the size by then); the first failure ends the call."""
        waiting: Waiting = [(part.first, 1, 0, part) for part in parts]  # in input order: a heap already
        out: dict[asyncio.Task[pb.EmbedResponse], Flight] = {}
        rows: dict[int, np.ndarray] = {}
        try:
            while waiting or out:
                assert self._budget is not None
                self._budget.read_if_due()
                self._send_what_fits(waiting, out, deadline, chunked)
                if deadline.left() <= 0:
                    raise Unavailable(grpc.StatusCode.DEADLINE_EXCEEDED, f"timeout_s: not done in {self._timeout} s")
                if not out:  # held by a pushback, or the window is filled by another call's parts
                    await asyncio.sleep(min(self._retrying.held_s() or BLOCKED_POLL_S, max(0.0, deadline.left())))
                    continue
                done, _ = await asyncio.wait(out, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    flight = out.pop(task)
                    self._settled(flight)
                    self._settle(flight, task, rows, waiting, deadline)
        finally:
            for task, flight in out.items():  # the call failed or was cancelled: its other parts are not awaited
                task.cancel()
                self._settled(flight)
        return rows

    def _settled(self, flight: Flight) -> None:
        """A part is no longer out."""
        assert self._budget is not None
        self._out -= 1
        self._budget.settled(flight.cost)

    def _send_what_fits(
        self, waiting: Waiting, out: dict[asyncio.Task[pb.EmbedResponse], Flight], deadline: Deadline, chunked: bool
    ) -> None:
        """Send the parts that the pushback, the window and the budget let go now, each cut to the
        size the server takes and to its share of the budget."""
        assert self._size is not None and self._budget is not None
        budget = self._budget
        while waiting and not self._retrying.held_s() and self._window.admits(self._out):
            _, attempt, sent, part = heapq.heappop(waiting)
            texts = min(self._size.texts, budget.fitting(part.request.texts, chunked))
            if len(part) > texts:  # the rest goes next
                part, rest = part.split(texts)
                heapq.heappush(waiting, (rest.first, attempt, sent, rest))
            cost = budget.cost(part.request.texts, chunked)
            if not budget.admits(cost):  # it waits for an answer, of this call or another
                heapq.heappush(waiting, (part.first, attempt, sent, part))
                return
            echo = time.monotonic() - self._answered_at < ECHO_S
            flight = Flight(part, self._window.epoch, self._out, echo, attempt, sent, cost)
            out[asyncio.ensure_future(self._attempt(self._stub.Embed, part.request, deadline, sent))] = flight
            self._out += 1
            budget.sent(cost)

    def _settle(
        self,
        flight: Flight,
        task: asyncio.Task[pb.EmbedResponse],
        rows: dict[int, np.ndarray],
        waiting: Waiting,
        deadline: Deadline,
    ) -> None:
        """A part's answer: its rows kept, the window and the size grown; or it goes again, as
        :meth:`_next_attempt` says; or its error ends the call."""
        part = flight.part
        try:
            answer = task.result()
        except grpc.RpcError as error:
            attempt = self._next_attempt(flight, embed_error(error, part.first), deadline)
            heapq.heappush(waiting, (part.first, attempt, flight.sent + 1, part))
            return
        rows[part.first] = decode(answer)
        assert self._budget is not None
        self._budget.answered(part.request.texts, answer.token_counts)
        self._answered_at = time.monotonic()
        self._retrying.answered()
        self._window.succeeded()
        assert self._size is not None
        self._size.succeeded(len(part))

    def _next_attempt(self, flight: Flight, error: EmbedError, deadline: Deadline) -> int:
        """The attempt a failed part goes again as, or ``error`` raised when it is final. A refusal
        cuts the window. Of a part sent beside others of ours (or just after one was answered) it is
        the client's own window, the same attempt; beside one, the size halves too. Of a part out
        alone it is the server's overload: the size halves, and it is a retry after the pushback,
        which holds every part, within the attempts and the budget."""
        assert self._size is not None
        refused = error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        ours = refused and (flight.beside > 0 or flight.echo)
        if refused:
            self.refusals += 1
            self._window.refused(flight.epoch)
            if flight.beside == 1 or not ours:
                self._size.refused(len(flight.part))
        if ours:  # the window, cut, waits for our parts out; the hold only outlasts the echo
            pushback = error.retry_after_s or 0.0
            if pushback > deadline.left():
                raise error from None
            self._retrying.hold(min(pushback, ECHO_S))
            return flight.attempt
        wait = self._retrying.wait_s(error, flight.attempt, deadline)
        if wait is None:
            raise error from None
        self._retrying.hold(wait)  # a backoff too: the server is away for every part
        return flight.attempt + 1

    async def _call(self, call: Callable[..., Awaitable[T]], request: Any, deadline: Deadline) -> T:
        """One request, retried after a pushback or a backoff within the deadline and the budget."""
        attempt = 1
        while True:
            if held := self._retrying.held_s():  # another request's pushback holds this one too
                await asyncio.sleep(min(held, max(0.0, deadline.left())))
            try:
                answer = await self._attempt(call, request, deadline, attempt - 1)
            except grpc.RpcError as error:
                failure = embed_error(error)
                self.refusals += failure.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                wait = self._retrying.wait_s(failure, attempt, deadline)
                if wait is None:
                    raise failure from None
                await asyncio.sleep(wait)
                attempt += 1
            else:
                self._retrying.answered()
                return answer

    async def _attempt(self, call: Callable[..., Awaitable[T]], request: Any, deadline: Deadline, earlier: int) -> T:
        """One attempt of a call, with what is left of its deadline. One that sends work ``earlier``
        attempts sent already says so (``kembed-retry-attempt``), so the server counts that work once
        in its demand (kembed_demand_ratio)."""
        marker = ((RETRY_ATTEMPT_KEY, str(earlier)),) if earlier else None
        return await call(request, timeout=deadline.attempt_s(), metadata=marker)

    async def close(self) -> None:
        if self._budget is not None:
            self._budget.close()
        await self._channel.close(None)

    async def __aenter__(self) -> AsyncEmbedClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()


def tokens_request(sequences: Sequence[Sequence[int]], normalize: bool, dimensions: int) -> pb.EmbedRequest:
    ids = np.concatenate([np.asarray(seq, dtype="<i4") for seq in sequences])
    tokens = pb.TokenIds(ids=ids.tobytes(), lengths=[len(seq) for seq in sequences])
    return pb.EmbedRequest(tokens=tokens, normalize=normalize, dimensions=dimensions)
