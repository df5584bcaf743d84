"""One call's path through a front end, whatever edge it came in by: validate → pre-screen →
tokenize → admit → engine → result; and when the answer to a refusal may be sent, paced per client.

Every edge hands it an :class:`~kembed.frontend.call.EmbedCall` (its limits checked while the edge
read it) and maps the :class:`~kembed.frontend.call.EmbedResult` back. Every failure is an
:class:`~kembed.domain.errors.EmbedError`: bad input is INVALID_ARGUMENT (an ``InvalidInput`` that locates
it) before it can reach a shared batch; admission refusals are REJECTED with a pushback; warming up
or draining is UNAVAILABLE; work whose deadline passed is dropped before compute and answered
DEADLINE. Each edge maps them to its transport's codes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import tokenizers

from kembed import __version__
from kembed.config.settings import Settings
from kembed.domain.errors import EmbedError, Failure, Field, InvalidInput
from kembed.domain.inputs import Sequences, Tokenizer, TokenLimit
from kembed.domain.prompts import ModelPrompts
from kembed.domain.texts import NO_CONTENT, has_content
from kembed.frontend.budget import MemoryBudget, call_weight
from kembed.frontend.call import EmbedCall, EmbedResult, ServerInfo, Texts, Timings
from kembed.frontend.chunks import Chunking, Chunks
from kembed.frontend.gate import Gate, warming_up
from kembed.frontend.inbox import Pending
from kembed.frontend.link import EngineLink
from kembed.frontend.pushback import PacedAnswers, RefusalPacer
from kembed.frontend.quantize import encode
from kembed.frontend.screen import Screen, Waits
from kembed.metrics import FrontendMetrics
from kembed.plumbing.runtime import read_serving
from kembed.policy.admission import Rejection
from kembed.policy.priority import Priority
from kembed.policy.shapes import padded_tokens

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256
# Inputs up to this many characters or id bytes are tokenized on the event loop: a trip through the
# executor (two thread switches and a loop wake-up) costs more than tokenizing a sentence. Larger
# inputs go to the executor, where the Rust tokenizer runs without the GIL.
INLINE_PREPARE_LIMIT = 2048
# The weight of each call in the average of its padded cost over its pre-screen bound.
COST_RATIO_WEIGHT = 0.05
# Counting words for the pre-screen costs a fiftieth of tokenizing; above this many characters a
# request's words are not counted on the event loop, and it is pre-screened at one token an item.
WORD_COUNT_LIMIT = 65536
_LEAST_NORM = np.float32(1e-12)  # a zero row stays zero


class Prompt(NamedTuple):
    """The text put before each of a call's texts, and its tokens (without special tokens)."""

    text: str
    tokens: int


NO_PROMPT = Prompt("", 0)


class Service(Protocol):
    """What the edges call: the real path once the engine is warm, a refusal before."""

    async def embed(self, call: EmbedCall) -> EmbedResult: ...

    async def tokenize(self, call: EmbedCall) -> Chunks: ...

    async def pace(self, client: str, weight: float = 1.0) -> None:
        """A call of ``client`` was refused (REJECTED), weighing ``weight`` refusals (its bytes:
        :func:`~kembed.frontend.pushback.refusal_weight`): return when its answer may be sent. The
        edge calls it once it holds nothing of the call's but what answering it needs."""

    def info(self) -> ServerInfo: ...


class WarmingUp:
    """The service until the engine is warm: every call is UNAVAILABLE."""

    async def embed(self, call: EmbedCall) -> EmbedResult:
        raise warming_up()

    async def tokenize(self, call: EmbedCall) -> Chunks:
        raise warming_up()

    async def pace(self, client: str, weight: float = 1.0) -> None:
        return None

    def info(self) -> ServerInfo:
        raise warming_up()


class EmbedService:
    """One request's path, independent of the RPC shape (unary or stream)."""

    def __init__(
        self,
        settings: Settings,
        link: EngineLink,
        screen: Screen,
        gate: Gate,
        metrics: FrontendMetrics,
        executor: Executor,
        memory: MemoryBudget,
        runtime: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        info = link.info
        self._runtime = runtime  # where the engine says which forward serves
        self._settings = settings
        self._info = info
        self._link = link
        self._screen = screen
        self._gate = gate
        self._metrics = metrics
        self._executor = executor
        self._memory = memory
        self._clock = clock
        self._bucket_lengths = list(info.bucket_lengths)
        self._cost_over_least = 1.0  # padded cost over its pre-screen bound, averaged over calls
        self._pacer = RefusalPacer(
            settings.refusal_rate, settings.refusal_burst, clock, on_shared=metrics.refusals_shared.inc
        )
        self._paced = PacedAnswers(self._pacer, on_paced=metrics.refusals_paced.inc)
        self._prompts = ModelPrompts(info.prompts, info.default_prompt_name)
        self._tokenizer = Tokenizer(
            tokenizers.Tokenizer.from_str(info.tokenizer_json),
            pad_token_id=info.pad_token_id,
            max_input_tokens=info.max_input_tokens,
            vocab_size=info.vocab_size,
        )
        tokenizer = self._tokenizer
        # The model's prompts, counted once: a literal one is counted with each call that sends it.
        self._model_prompts = {text: Prompt(text, tokenizer.count(text)) for text in info.prompts.values()}
        self._chunking = Chunking(info.max_input_tokens, tokenizer.head, tokenizer.tail, settings.max_chunks_per_input)

    async def embed(self, call: EmbedCall) -> EmbedResult:
        """The call is admitted or refused as it arrives, never held. What it holds is weighed against
        the front end's memory budget from its arrival until it is answered or refused; the edge
        paces a refusal's answer on the call's ``peer`` (:meth:`pace`), holding nothing meanwhile."""
        arrival = self._clock()
        self._gate.enter()
        try:
            self._validate(call)
            prompt = self._prompt(call)
            weight = call_weight(call.nbytes(prompt.text), self._most_items(call), self._info.dimensions)
            with self._memory.reserve(weight):
                return await self._serve(call, prompt, arrival)
        finally:
            self._gate.leave()

    async def pace(self, client: str, weight: float = 1.0) -> None:
        await self._paced.refused(client, weight)

    def _screened_cost(self, least: int, paced: bool) -> int:
        """The cost the pre-screen weighs: the lower bound, or, for a client whose refusals are being
        ``paced`` (it ignores its pushback), the bound scaled to what this front end's calls have
        cost, so that its calls at the margin are refused before a tokenization, not after one."""
        if paced:
            return max(least, int(least * self._cost_over_least))
        return least

    def _attempt(self, call: EmbedCall, paced: bool) -> int:
        """The call's earlier attempts as demand counts them: as its marker says, or, for a client
        whose refusals are being paced, at least one: it calls again faster than its pushback
        allows, a retry in all but its marker (925 KB bodies re-sent at once read 133 times the
        pod's capacity). Its burst is counted; what the pod admits of it is, as any call's."""
        return call.attempt or int(paced)

    def drain(self) -> None:
        """Answer every paced refusal now, and pace none from here on: a drain waits for no timer."""
        self._paced.drain()

    async def _serve(self, call: EmbedCall, prompt: Prompt, arrival: float) -> EmbedResult:
        chunking = self._chunking.with_prompt(prompt.tokens) if self._chunked(call) else None
        least = self._least_cost(call, chunking, prompt)
        paced = self._pacer.in_debt(call.peer)
        least_cost, attempt = self._screened_cost(least, paced), self._attempt(call, paced)
        priority = self._screen.class_of(least_cost, call.priority)
        stated = None if call.timeout_s is None else arrival + call.timeout_s  # the client's own deadline
        self._raise_if_rejected(self._screen.before_tokenizing(least_cost, priority, attempt, call.timeout_s), priority)
        with self._screen.tokenizing(least_cost, priority):
            chunks = await self._tokenized(call, chunking, prompt)
        tokenized = self._clock()
        seqs = chunks.seqs
        cost = self._padded_tokens(seqs.lengths)
        self._cost_over_least += COST_RATIO_WEIGHT * (cost / max(1, least) - self._cost_over_least)
        priority = self._screen.class_of(cost, priority)
        if priority is not call.priority:
            self._metrics.demoted.inc()
        waits = self._admit(cost, priority, attempt, None if stated is None else stated - tokenized)
        deadline = stated if stated is not None else arrival + self._default_budget(waits)
        tag, pending = self._link.submit(seqs, cost, arrival, deadline, priority)
        await self._wait(tag, pending, deadline, waits.expected)
        done = self._clock()
        self._link.add_latency(done - arrival, priority)
        self._metrics.request_durations[priority].observe(done - arrival)
        return self._result(call, chunks, pending, tokenized - arrival, arrival, done)

    async def tokenize(self, call: EmbedCall) -> Chunks:
        """The call's inputs as :meth:`embed` would hand them to the engine (prompt, truncation,
        chunks, the same checks and limits), and no further: nothing is computed. It is admitted as
        an embedding call of its cost is before tokenizing (its tokenizing takes the cores the
        compute does), weighed as work while it is tokenized, and not counted as demand."""
        self._gate.enter()
        try:
            self._validate(call)
            prompt = self._prompt(call)
            chunking = self._chunking.with_prompt(prompt.tokens) if self._chunked(call) else None
            least_cost = self._screened_cost(self._least_cost(call, chunking, prompt), self._pacer.in_debt(call.peer))
            priority = self._screen.class_of(least_cost, call.priority)
            rejection = self._screen.before_tokenizing(least_cost, priority, offered=False)
            self._raise_if_rejected(rejection, priority)
            with (
                self._memory.reserve(call_weight(call.nbytes(prompt.text), self._most_items(call), 0)),
                self._screen.tokenizing(least_cost, priority),
            ):
                return await self._tokenized(call, chunking, prompt)
        finally:
            self._gate.leave()

    async def _tokenized(self, call: EmbedCall, chunking: Chunking | None, prompt: Prompt) -> Chunks:
        """:meth:`_prepare`, on the event loop for a small call (no other call is screened meanwhile),
        else in the executor, the event loop free."""
        if call.nbytes(prompt.text) <= INLINE_PREPARE_LIMIT:
            return self._prepare(call, chunking, prompt)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._prepare, call, chunking, prompt)

    def _default_budget(self, waits: Waits) -> float:
        """The deadline of a call that states none: the server's default, or, for a request whose
        own work takes longer at the measured rate (an ingest of a thousand texts on a CPU), the
        longest it may wait for that work and what is ahead of it."""
        return max(self._settings.default_timeout_ms / 1000, waits.longest)

    def _validate(self, call: EmbedCall) -> None:
        """What the edges cannot check without the model."""
        if call.dimensions > self._info.dimensions:
            reason = f"{call.dimensions} exceeds the model's {self._info.dimensions}"
            raise InvalidInput(Field.DIMENSIONS, reason)
        if len(call.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidInput(Field.REQUEST_ID, f"longer than {MAX_REQUEST_ID_CHARS} characters")
        if call.encoding.needs_unit_vectors and not call.normalize:
            raise InvalidInput(
                Field.ENCODING, f"{call.encoding} takes normalised vectors: set normalize, or take float32"
            )
        if call.chunk and call.truncate:
            raise InvalidInput(
                Field.CHUNK, "chunk and truncate are both true: choose one (chunk embeds a long input whole)"
            )

    def _chunked(self, call: EmbedCall) -> bool:
        """Whether the call's long inputs are chunked: as it says, else the server's default where
        it does not ask to truncate them."""
        return call.chunk if call.chunk is not None else self._settings.chunk_long_inputs and not call.truncate

    def _most_items(self, call: EmbedCall) -> int:
        """The most items the engine may compute for the call: its inputs, or their chunks."""
        if not self._chunked(call):
            return call.count
        return min(call.count * self._chunking.max_chunks, self._settings.max_items_per_request)

    def _prepare(self, call: EmbedCall, chunking: Chunking | None, prompt: Prompt) -> Chunks:
        """The call's inputs as the items the engine computes: tokenized, and chunked if asked
        (``chunking``: every chunk starts with the prompt, as the whole input would)."""
        limit = self._limit(chunking)
        inputs = call.inputs
        if isinstance(inputs, Texts):
            _check_content(inputs.items)
            # As sentence-transformers does: the prompt and the text tokenized as one, so it counts
            # in the tokens, and truncation cuts the text's end, never the prompt.
            texts = [prompt.text + text for text in inputs.items] if prompt.text else inputs.items
            # Truncated from the left, the prompt stays: it is a prefix, not the text's start.
            left = self._tokenizer.left(prompt.text, prompt.tokens) if call.truncate_left else None
            seqs = self._tokenizer.from_texts(texts, call.truncate, limit, left)
        else:
            seqs = self._tokenizer.from_ids(inputs, call.truncate, limit, call.truncate_left)
        if chunking is None:
            return Chunks.whole(seqs)
        return chunking.split(seqs, self._settings.max_items_per_request)

    def _limit(self, chunking: Chunking | None) -> TokenLimit:
        """The most tokens an input may have: the model's, or what ``chunking``'s most chunks hold,
        fewer the more tokens a prompt repeats at the head of each."""
        if chunking is None:
            return self._tokenizer.limit
        most, max_chunks = chunking.max_tokens, chunking.max_chunks
        if (prompt := chunking.head - self._chunking.head) == 0:
            return TokenLimit(most, f"the {most} tokens of {max_chunks} chunks (max_chunks_per_input)", "split it")
        name = f"the {most} tokens of {max_chunks} chunks that each repeat the prompt's {prompt} (max_chunks_per_input)"
        return TokenLimit(most, name, "split it or shorten the prompt")

    def _prompt(self, call: EmbedCall) -> Prompt:
        """The text put before each of the call's texts: none before pre-tokenized ids, whose
        client tokenized what it wants embedded (a prompt asked for with them is refused)."""
        choice = call.prompt
        choice.check()
        if isinstance(call.inputs, Texts):
            text = self._prompts.text(choice)
            if not text:
                return NO_PROMPT
            # The model's own prompts were measured as it loaded; a literal one is measured here.
            return self._model_prompts.get(text) or self._literal_prompt(text)
        if choice.given:
            raise InvalidInput(
                choice.given[0], "not taken with pre-tokenized input: put the prompt's tokens in the ids"
            )
        return NO_PROMPT

    def _literal_prompt(self, text: str) -> Prompt:
        if (tokens := self._tokenizer.count(text)) > self._tokenizer.prompt_room:
            reason = f"{tokens} tokens, leaving no room for a text in the model's {self._info.max_input_tokens}"
            raise InvalidInput(Field.PROMPT, reason)
        return Prompt(text, tokens)

    def _least_cost(self, call: EmbedCall, chunking: Chunking | None, prompt: Prompt) -> int:
        """A lower bound of the call's padded cost, read without tokenizing, so that the pre-screen
        refuses what the server cannot take before it costs a tokenization: exact for pre-tokenized
        ids, from the word counts and the prompt's tokens for texts (see ``Tokenizer.least_lengths``).
        Chunked, it counts the chunks, and a call that would need more than a request holds is
        refused here."""
        limit = self._limit(chunking)
        inputs = call.inputs
        if isinstance(inputs, Sequences):
            lengths = np.clip(inputs.lengths, 1, limit.tokens)
        elif inputs.chars <= WORD_COUNT_LIMIT:
            lengths = self._tokenizer.least_lengths(inputs.items, limit, prompt.tokens)
        else:
            lengths = np.full(call.count, min(1 + prompt.tokens, limit.tokens), dtype=np.int64)
        if chunking is not None:
            lengths = chunking.lengths(lengths, chunking.check(lengths, self._settings.max_items_per_request))
        return self._padded_tokens(lengths)

    def _padded_tokens(self, lengths: np.ndarray) -> int:
        """What items of these lengths cost once each is padded to its bucket."""
        return padded_tokens(lengths, self._bucket_lengths)

    def _admit(self, cost: int, priority: Priority, attempt: int, seconds_left: float | None) -> Waits:
        """Admit the call at its exact cost, or raise; what it waits, admitted."""
        limit = self._settings.max_queued_tokens
        if cost > limit:
            reason = f"the request needs {cost} padded tokens, more than the server queues at once ({limit}): split it"
            raise InvalidInput(Field.INPUT, reason)
        decided = self._screen.after_tokenizing(cost, priority, attempt, seconds_left)
        if isinstance(decided, Rejection):
            raise self._refused(decided, priority)
        return decided

    def _raise_if_rejected(self, rejection: Rejection | None, priority: Priority) -> None:
        if rejection is not None:
            raise self._refused(rejection, priority)

    def _refused(self, rejection: Rejection, priority: Priority) -> EmbedError:
        """The refusal, counted."""
        self._metrics.rejected.labels(reason=rejection.reason, priority=priority.label).inc()
        log.debug("refused (%s): %s", rejection.reason, rejection.message)
        return EmbedError(Failure.REJECTED, rejection.message, rejection.retry_after_ms)

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

    def _result(
        self, call: EmbedCall, chunks: Chunks, pending: Pending, tokenize_s: float, arrival: float, done: float
    ) -> EmbedResult:
        queue_s = max(0.0, pending.last_start - arrival - tokenize_s)
        self._metrics.stages(tokenize_s, queue_s, pending.inference_s)
        log.debug(
            "answered: %d items; tokenize %.1f ms, queue %.1f ms, compute %.1f ms, total %.1f ms",
            *(call.count, 1000 * tokenize_s, 1000 * queue_s, 1000 * pending.inference_s, 1000 * (done - arrival)),
        )
        vectors = postprocess(chunks.combine(pending.embeddings), call.dimensions, call.normalize)
        return EmbedResult(
            embeddings=encode(vectors, call.encoding),
            token_counts=chunks.token_counts(),
            request_id=call.request_id,
            timings=Timings(queue_s, tokenize_s, pending.inference_s, done - arrival),
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


def _check_content(texts: Sequence[str]) -> None:
    """Refuse the first text without content (``kembed/domain/texts.py``): embedded, it would be its
    special tokens alone. Here, where a large call is tokenized off the event loop, since a text
    without content is read to its end."""
    for index, content in enumerate(map(has_content, texts)):
        if not content:
            raise InvalidInput(Field.INPUT, NO_CONTENT, index)


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
