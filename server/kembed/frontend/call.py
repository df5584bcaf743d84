"""The front end's domain: one embedding call as every edge hands it to the service, and its answer.

Each edge maps its wire format to an :class:`EmbedCall`, and an :class:`EmbedResult` back to its own
(``grpc_api``: protobuf; ``openai_api``: OpenAI's JSON). An edge checks the :class:`Limits` while it
reads its input, before it builds anything proportional to it, so a call that reaches the service
holds at most ``max_items`` items, no text over ``max_text_chars`` characters, no empty text and no
empty sequence of ids. What needs the model (the vocabulary, lengths in tokens, dimensions) the service checks. Bad
input is an :class:`~kembed.domain.errors.InvalidInput` that locates it as data, for each edge to name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kembed.config.settings import Settings
from kembed.domain.errors import Field, InvalidInput
from kembed.domain.inputs import Sequences
from kembed.domain.prompts import NO_CHOICE, PromptChoice
from kembed.domain.texts import EMPTY as EMPTY_TEXT
from kembed.frontend.quantize import Encoding
from kembed.ipc.protocol import ServingInfo
from kembed.policy.priority import Priority

EMPTY_IDS = "an empty array of token ids"


@dataclass(frozen=True, slots=True)
class Texts:
    items: Sequence[str]
    chars: int  # all of them together


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbedCall:
    inputs: Texts | Sequences  # texts, or pre-tokenized ids
    truncate: bool = False  # cut over-long inputs to the model's limit instead of refusing them
    truncate_left: bool = False  # truncate keeps an input's end, not its start (TEI's truncation_direction=left)
    chunk: bool | None = None  # embed over-long inputs as chunks (frontend/chunks.py); None = the server's default
    normalize: bool = True
    dimensions: int = 0  # keep the first this many (0 = all), then normalize
    encoding: Encoding = Encoding.FLOAT32  # the vectors as answered: float32, or quantized (quantize.py)
    priority: Priority = Priority.INTERACTIVE
    prompt: PromptChoice = NO_CHOICE
    request_id: str = ""  # echoed in the answer
    timeout_s: float | None = None  # what the caller allows from arrival; None = the server's default
    peer: str = ""  # the caller, where its pushback is enforced: its connection (gRPC), its address (REST)
    attempt: int = 0  # earlier attempts, as the client's retry marker says: a retry is not counted again as demand

    @property
    def count(self) -> int:
        """Its items: texts or sequences."""
        inputs = self.inputs
        return len(inputs.items) if isinstance(inputs, Texts) else inputs.count

    def nbytes(self, prompt: str) -> int:
        """Its inputs' bytes, near enough: a character of text counts one, a token id four, and the
        ``prompt`` put before each text counts with each (a thousand one-letter texts after a prompt
        of a thousand characters are a million to tokenize). What tokenizing or checking it costs,
        and what it holds in memory within a small factor."""
        inputs = self.inputs
        if isinstance(inputs, Texts):
            return inputs.chars + len(prompt) * len(inputs.items)
        return int(inputs.ids.nbytes)


@dataclass(frozen=True, slots=True)
class Timings:
    queue_s: float  # from tokenized until its last item's batch started
    tokenize_s: float
    inference_s: float  # compute time of the batches its items ran in
    total_s: float


@dataclass(frozen=True, slots=True)
class EmbedResult:
    embeddings: np.ndarray  # in the call's order: float32 [items, dimensions], or as its encoding has it
    token_counts: np.ndarray  # int32 [items]: each item's tokens, as computed (truncated or not)
    request_id: str
    timings: Timings
    encoding: Encoding  # the call's
    dimensions: int  # the vectors', whatever the encoding (a binary row holds ceil(dimensions / 8) bytes)

    def timing_headers(self) -> list[tuple[str, str]]:
        """TEI's timing headers, in whole milliseconds as TEI sends them, and the tokens computed:
        REST answers them as headers, gRPC in its trailing metadata."""
        timings = self.timings
        return [
            ("x-total-time", str(round(timings.total_s * 1000))),
            ("x-tokenization-time", str(round(timings.tokenize_s * 1000))),
            ("x-queue-time", str(round(timings.queue_s * 1000))),
            ("x-inference-time", str(round(timings.inference_s * 1000))),
            ("x-compute-tokens", str(int(self.token_counts.sum()))),
        ]


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What ``Info`` tells: the engine's serving info, and how this server takes calls."""

    serving: ServingInfo
    server_version: str
    max_batch_items: int
    batching: str
    max_text_chars: int  # longer texts are refused, or cut with truncate
    max_message_bytes: int
    served_model_name: str  # KEMBED_SERVED_MODEL_NAME, else the model id
    max_chunks_per_input: int  # with chunk, an input is embedded as at most this many chunks
    chunk_long_inputs: bool  # the server's default for a call that sets neither chunk nor truncate
    forward: str  # what computes now: eager, compiled or graphs (a CPU's compile ends while serving)
    admission_budget_tokens: int = 0  # padded tokens admitted at once now, on an otherwise idle server
    max_connection_age_ms: int = 0  # then GOAWAY; a call still open after the grace is cut
    max_connection_age_grace_ms: int = 0


@dataclass(frozen=True, slots=True)
class Limits:
    """What one call may hold, checked by each edge while it reads the call."""

    max_items: int
    max_text_chars: int

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(settings.max_items_per_request, settings.max_text_chars)

    def check_count(self, count: int) -> None:
        """Check before walking the items: a list of millions is refused at its length."""
        if count == 0:
            raise InvalidInput(Field.INPUT, "no inputs")
        if count > self.max_items:
            raise InvalidInput(Field.INPUT, f"{count} inputs, at most {self.max_items} per request")

    def check_item(self, index: int) -> None:
        """Check before reading item ``index`` of a list whose length is not known yet."""
        if index == self.max_items:
            raise InvalidInput(Field.INPUT, f"more than {self.max_items} inputs, at most {self.max_items} per request")

    @staticmethod
    def check_size(size: int, index: int, ids: bool = False) -> None:
        """One rule for empty inputs on every edge, OpenAI's: refused, naming the item (embedded, an
        empty text would be its special tokens alone: a vector that means nothing)."""
        if size == 0:
            raise InvalidInput(Field.INPUT, EMPTY_IDS if ids else EMPTY_TEXT, index)

    def check_sizes(self, sizes: Sequence[int] | np.ndarray, ids: bool = False) -> None:
        """:meth:`check_size` of each item, at once."""
        if len(sizes) and min(sizes) == 0:
            self.check_size(0, int(np.argmin(sizes)), ids)

    def check_chars(self, chars: int, index: int) -> None:
        if chars > self.max_text_chars:
            raise InvalidInput(Field.INPUT, f"{chars} characters, more than {self.max_text_chars}", index)

    def texts(self, items: Sequence[str], truncate: bool = False, left: bool = False) -> Texts:
        """``items`` (strings) as a call's texts, their count and each one's characters checked. With
        ``truncate`` a text over the character limit is cut to it rather than refused (its start,
        or ``left`` its end): the limit bounds the tokenizer's work, and what it drops lies past any
        model's input limit anyway."""
        self.check_count(len(items))
        sizes = list(map(len, items))
        self.check_sizes(sizes)
        limit = self.max_text_chars
        if max(sizes) > limit:
            if truncate:
                items = [cut_chars(text, limit, left) for text in items]
                return Texts(items, sum(min(size, limit) for size in sizes))
            index = next(i for i, chars in enumerate(sizes) if chars > limit)
            self.check_chars(sizes[index], index)
        return Texts(items, sum(sizes))


def cut_chars(text: str, limit: int, left: bool) -> str:
    """``text`` cut to ``limit`` characters: its first, or ``left`` its last."""
    if len(text) <= limit:
        return text
    return text[len(text) - limit :] if left else text[:limit]
