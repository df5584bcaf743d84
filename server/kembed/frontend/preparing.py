"""Preparing one call's inputs as the engine computes them: its model checks, its prompt and how
its long inputs are cut (:class:`Plan`, decided before anything proportional to it is built), then
its tokens and chunks.

The pipeline (``service.py``) plans a call first, costs it from the plan before tokenizing it
(``costing.py``), and tokenizes it only once it passed the pre-screen. A small call is tokenized on
the event loop, a large one in the executor, where the Rust tokenizer runs without the GIL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import tokenizers

from kembed.config.settings import Settings
from kembed.domain.errors import Field, InvalidInput
from kembed.domain.inputs import Tokenizer, TokenLimit
from kembed.domain.prompts import ModelPrompts
from kembed.domain.texts import NO_CONTENT, has_content
from kembed.frontend.budget import call_weight
from kembed.frontend.call import EmbedCall, Texts
from kembed.frontend.chunks import Chunking, Chunks
from kembed.ipc.protocol import ServingInfo

MAX_REQUEST_ID_CHARS = 256
# Inputs up to this many characters or id bytes are tokenized on the event loop: a trip through the
# executor (two thread switches and a loop wake-up) costs more than tokenizing a sentence. Larger
# inputs go to the executor, where the Rust tokenizer runs without the GIL.
INLINE_PREPARE_LIMIT = 2048


@dataclass(frozen=True, slots=True)
class Prompt:
    """The text put before each of a call's texts, and its tokens (without special tokens)."""

    text: str
    tokens: int


NO_PROMPT = Prompt("", 0)


@dataclass(frozen=True, slots=True)
class Plan:
    """How one call is prepared, decided from the call alone: its prompt, its chunks' shape (None:
    not chunked), the most tokens an input may have, the most items it may become, and the bytes
    it holds while it is served."""

    prompt: Prompt
    chunking: Chunking | None
    limit: TokenLimit
    most_items: int
    nbytes: int


class Preparing:
    """The model's tokenizer, prompts and chunk shape, applied to calls."""

    def __init__(self, settings: Settings, info: ServingInfo, executor: Executor) -> None:
        self._settings = settings
        self._info = info
        self._executor = executor
        self._prompts = ModelPrompts(info.prompts, info.default_prompt_name)
        self.tokenizer = Tokenizer(
            tokenizers.Tokenizer.from_str(info.tokenizer_json),
            pad_token_id=info.pad_token_id,
            max_input_tokens=info.max_input_tokens,
            vocab_size=info.vocab_size,
        )
        tokenizer = self.tokenizer
        # The model's prompts, counted once: a literal one is counted with each call that sends it.
        self._model_prompts = {text: Prompt(text, tokenizer.count(text)) for text in info.prompts.values()}
        self._chunking = Chunking(info.max_input_tokens, tokenizer.head, tokenizer.tail, settings.max_chunks_per_input)

    def plan(self, call: EmbedCall) -> Plan:
        """Check what the edges cannot check without the model, and decide how the call is prepared."""
        self._check(call)
        prompt = self._prompt(call)
        chunking = self._chunking.with_prompt(prompt.tokens) if self._chunked(call) else None
        most_items = call.count if chunking is None else self._most_chunks(call)
        return Plan(prompt, chunking, self._limit(chunking), most_items, call.nbytes(prompt.text))

    def weight(self, plan: Plan, dimensions: int) -> int:
        """What the call holds in memory while it is served, answers of ``dimensions`` included."""
        return call_weight(plan.nbytes, plan.most_items, dimensions)

    async def tokenized(self, call: EmbedCall, plan: Plan) -> Chunks:
        """The call's items, on the event loop for a small call (no other call is screened
        meanwhile), else in the executor, the event loop free."""
        if plan.nbytes <= INLINE_PREPARE_LIMIT:
            return self._prepare(call, plan)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._prepare, call, plan)

    def _check(self, call: EmbedCall) -> None:
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

    def _most_chunks(self, call: EmbedCall) -> int:
        return min(call.count * self._chunking.max_chunks, self._settings.max_items_per_request)

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
        if (tokens := self.tokenizer.count(text)) > self.tokenizer.prompt_room:
            reason = f"{tokens} tokens, leaving no room for a text in the model's {self._info.max_input_tokens}"
            raise InvalidInput(Field.PROMPT, reason)
        return Prompt(text, tokens)

    def _limit(self, chunking: Chunking | None) -> TokenLimit:
        """The most tokens an input may have: the model's, or what ``chunking``'s most chunks hold,
        fewer the more tokens a prompt repeats at the head of each."""
        if chunking is None:
            return self.tokenizer.limit
        most, max_chunks = chunking.max_tokens, chunking.max_chunks
        if (prompt := chunking.head - self._chunking.head) == 0:
            return TokenLimit(most, f"the {most} tokens of {max_chunks} chunks (max_chunks_per_input)", "split it")
        name = f"the {most} tokens of {max_chunks} chunks that each repeat the prompt's {prompt} (max_chunks_per_input)"
        return TokenLimit(most, name, "split it or shorten the prompt")

    def _prepare(self, call: EmbedCall, plan: Plan) -> Chunks:
        """The call's inputs as the items the engine computes: tokenized, and chunked if planned
        (every chunk starts with the prompt, as the whole input would)."""
        inputs, prompt = call.inputs, plan.prompt
        if isinstance(inputs, Texts):
            _check_content(inputs.items)
            # As sentence-transformers does: the prompt and the text tokenized as one, so it counts
            # in the tokens, and truncation cuts the text's end, never the prompt.
            texts = [prompt.text + text for text in inputs.items] if prompt.text else inputs.items
            # Truncated from the left, the prompt stays: it is a prefix, not the text's start.
            left = self.tokenizer.left(prompt.text, prompt.tokens) if call.truncate_left else None
            seqs = self.tokenizer.from_texts(texts, call.truncate, plan.limit, left)
        else:
            seqs = self.tokenizer.from_ids(inputs, call.truncate, plan.limit, call.truncate_left)
        if plan.chunking is None:
            return Chunks.whole(seqs)
        return plan.chunking.split(seqs, self._settings.max_items_per_request)


def _check_content(texts: Sequence[str]) -> None:
    """Refuse the first text without content (``kembed/domain/texts.py``): embedded, it would be its
    special tokens alone. Here, where a large call is tokenized off the event loop, since a text
    without content is read to its end."""
    for index, content in enumerate(map(has_content, texts)):
        if not content:
            raise InvalidInput(Field.INPUT, NO_CONTENT, index)
