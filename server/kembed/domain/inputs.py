"""Client input to validated token ids: texts are tokenized here, pre-tokenized ids are checked
against the model here.

Everything a client controls is validated before it reaches a shared batch: one bad item must fail
its own request with INVALID_ARGUMENT, never the batch (an out-of-vocabulary id is a device-side
assert on CUDA that poisons the process). The edges have checked what needs no model (counts,
characters, empty items: ``frontend/call.py``); this module checks what does (the vocabulary, the
model's length limit). Pre-tokenized input is handled with vectorised numpy only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tokenizers

from kembed.domain.errors import Field, InvalidInput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Files that decide how text becomes ids; *.model covers sentencepiece tokenizers.
_TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.txt",
        "vocab.json",
        "merges.txt",
    }
)


_TRUNCATE = "set truncate=true to cut it to fit, or chunk=true to embed it whole as chunks"


@dataclass(frozen=True, slots=True)
class TokenLimit:
    """The most tokens an input may have, special tokens included, and what an error past it says:
    the model's limit, or, with ``chunk``, what an input's most chunks hold."""

    tokens: int
    name: str  # "the model's 256 tokens"
    advice: str  # how to make it fit


@dataclass(frozen=True, slots=True)
class Left:
    """Truncation from the left (TEI's ``truncation_direction=left``): an input keeps its last
    tokens, after its leading special tokens and the ``prompt`` at its head, which is never cut."""

    prompt: str  # "" for none
    ids: list[int]  # the prompt's, without special tokens
    tokens: int  # len(ids)


@dataclass(frozen=True)
class Sequences:
    """Token sequences, concatenated: ``ids[offsets[i] : offsets[i] + lengths[i]]`` is sequence ``i``."""

    ids: np.ndarray  # int32 [sum(lengths)]
    lengths: np.ndarray  # int32 [n], each >= 1

    @property
    def count(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def offsets(self) -> np.ndarray:
        ends = np.cumsum(self.lengths, dtype=np.int64)
        return ends - self.lengths


class Tokenizer:
    """The model's fast tokenizer and the checks that need the model; safe to call from many threads at once.

    The Rust tokenizer is configured once here, in two private copies (with and without truncation),
    and only read afterwards: changing truncation per call, as ``PreTrainedTokenizerFast.__call__``
    does, races between threads ("Already borrowed").
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        pad_token_id: int,
        max_input_tokens: int,
        vocab_size: int,
    ) -> None:
        self.max_input_tokens = max_input_tokens
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self._full = _configured_copy(backend, max_length=None)
        self._truncating = _configured_copy(backend, max_length=max_input_tokens)
        self._special_tokens = len(self._full.encode("", add_special_tokens=True).ids)
        # The special tokens before a text's own and after them ([CLS] and [SEP] for BERT).
        mask = self._full.encode("a", add_special_tokens=True).special_tokens_mask
        self.head = next((i for i, special in enumerate(mask) if not special), len(mask))
        self.tail = len(mask) - self.head - mask.count(0)
        self.limit = TokenLimit(max_input_tokens, f"the model's {max_input_tokens} tokens", _TRUNCATE)
        # Texts up to this many characters are tokenized whole, in one batch: a text of a token a
        # character (``"a." * n`` for WordPiece) then costs at most four times the work of the
        # longest a model takes, and most texts (prose of up to 400 words) take the fast path.
        # Longer texts are tokenized from prefixes.
        self.whole_chars = 4 * (max_input_tokens + 1)

    @classmethod
    def from_transformers(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_input_tokens: int,
        vocab_size: int,
    ) -> Tokenizer:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer; kembed needs one")
        # Padded positions are masked out, so any in-vocabulary id pads a model without a pad token.
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return cls(backend, pad_token_id=pad_token_id, max_input_tokens=max_input_tokens, vocab_size=vocab_size)

    def to_json(self) -> str:
        """The tokenizer, serialized for another process (padding and truncation reset)."""
        return str(self._full.to_str())

    def from_texts(
        self, texts: Sequence[str], truncate: bool, limit: TokenLimit | None = None, left: Left | None = None
    ) -> Sequences:
        """Each text's tokens, the work bounded by the ``limit`` (the model's by default; truncation
        cuts to the model's) whatever the text: a text of more than ``whole_chars`` characters, or
        four times the limit, is tokenized from prefixes (:meth:`_from_prefix`), or, truncated
        ``left``, from suffixes (:meth:`_from_suffix`)."""
        limit = limit or self.limit
        left = left if truncate else None
        encoded: list[list[int]] = [[] for _ in texts]
        whole, cut = [], set()  # tokenized whole, in one batch; from a prefix
        whole_chars = 4 * (limit.tokens + 1)  # self.whole_chars at the model's limit
        for i, text in enumerate(texts):
            if len(text) <= whole_chars:
                part = None
            elif left is not None:
                part = self._from_suffix(text[len(left.prompt) :], left)
            else:
                part = self._from_prefix(text, truncate, limit.tokens)
            if part is None:
                whole.append(i)
            else:
                encoded[i] = part
                cut.add(i)
        backend = self._truncating if truncate and left is None else self._full
        batch = backend.encode_batch_fast([texts[i] for i in whole], add_special_tokens=True)
        for i, encoding in zip(whole, batch, strict=True):
            encoded[i] = encoding.ids if left is None else self._cut_left(encoding.ids, left.tokens)
        lengths = np.fromiter(map(len, encoded), dtype=np.int32, count=len(encoded))
        if not truncate and (too_long := lengths > limit.tokens).any():
            index = int(np.argmax(too_long))
            if index in cut:  # only a prefix was tokenized: how many more tokens the text has is not known
                raise InvalidInput(Field.INPUT, f"over {limit.name}; {limit.advice}", index)
        self._check_lengths(lengths, truncate, limit)
        ids = np.fromiter(chain.from_iterable(encoded), dtype=np.int32, count=int(lengths.sum()))
        return Sequences(ids=ids, lengths=lengths)

    def _from_prefix(self, text: str, truncate: bool, limit: int) -> list[int] | None:
        """A long text's ids from the shortest prefix that holds more tokens than ``limit`` (not
        truncated, all of that prefix's: over the limit; truncated, cut to the model's), or None
        once a prefix would be half the text (it is tokenized whole, with the short texts). The
        first prefix is as many characters as the limit (a text of a token a character fills it at
        once); each next one is what the tokens per character so far say holds the limit, a
        quarter more, and at least twice as long."""
        content = limit - self._special_tokens  # tokens of its own a text may have
        size = limit + 1
        while 2 * size < len(text):
            encoding = self._full.encode(text[:size], add_special_tokens=True)
            exact = _exact_tokens(encoding)
            if exact >= content:
                # At least that many, and the cut words are one token more: over the limit.
                return _truncated(encoding, content) if truncate else encoding.ids
            size = max(2 * size, size * (content + 1) * 5 // (4 * max(exact, 1)))
        return None

    def _cut_left(self, ids: list[int], prompt_tokens: int) -> list[int]:
        """``ids`` cut to the model's limit from the left: its leading special tokens and the
        prompt's, then its last tokens (the trailing special tokens among them)."""
        if len(ids) <= self.max_input_tokens:
            return ids
        kept = self.head + prompt_tokens
        return ids[:kept] + ids[len(ids) - (self.max_input_tokens - kept) :]

    def _from_suffix(self, text: str, left: Left) -> list[int] | None:
        """A long text's ids truncated from the left, from the shortest suffix that holds what the
        model's limit keeps of it, as :meth:`_from_prefix` reads prefixes; the prompt's ids between
        the leading special tokens and those (the prompt is a prefix: never cut)."""
        content = self.max_input_tokens - self._special_tokens - left.tokens  # of the text's own
        size = self.max_input_tokens + 1
        while 2 * size < len(text):
            encoding = self._full.encode(text[-size:], add_special_tokens=True)
            ids, words = encoding.ids, encoding.word_ids
            first = next((w for w in words if w is not None), 0)
            # The tokens after the suffix's first two words: a cut can change how the word it
            # falls in, and whitespace after it, split; each word is at least one token.
            exact = [i for i, w in enumerate(words) if w is not None and w > first + 1]
            if len(exact) >= content:
                own = [ids[i] for i in exact[len(exact) - content :]]
                return ids[: self.head] + left.ids + own + ids[len(ids) - self.tail :]
            size = max(2 * size, size * (content + 1) * 5 // (4 * max(len(exact), 1)))
        return None

    def left(self, prompt: str, prompt_tokens: int) -> Left:
        """What truncating from the left keeps at an input's head: the ``prompt`` before each text."""
        return Left(prompt, self._full.encode(prompt, add_special_tokens=False).ids if prompt else [], prompt_tokens)

    def count(self, text: str) -> int:
        """The tokens of ``text`` alone, without special tokens (a prompt's)."""
        return len(self._full.encode(text, add_special_tokens=False).ids)

    @property
    def prompt_room(self) -> int:
        """The most tokens a prompt may have: it leaves room for one of a text's own within the
        model's limit (truncation cuts a text, never its prompt)."""
        return self.max_input_tokens - self._special_tokens - 1

    def crowds_out(self, prompt: str) -> int | None:
        """The tokens of ``prompt`` when they leave no room for a text's within the model's limit, else None."""
        tokens = self.count(prompt)
        return tokens if tokens > self.prompt_room else None

    def least_lengths(
        self, texts: Sequence[str], limit: TokenLimit | None = None, prompt_tokens: int = 0
    ) -> np.ndarray:
        """A lower bound of each text's length in tokens, at a fiftieth of tokenizing's cost: its
        words plus the special tokens and the ``prompt_tokens`` put before it. Tokenizers split on
        whitespace before anything else, so a word is at least one token (English prose averages
        1.5: the bound is about two thirds of the length); capped at the ``limit`` (the model's by
        default), where truncation or a refusal ends it."""
        words = np.fromiter((len(text.split()) for text in texts), dtype=np.int64, count=len(texts))
        return np.minimum(words + self._special_tokens + prompt_tokens, (limit or self.limit).tokens)

    def from_ids(
        self, seqs: Sequences, truncate: bool, limit: TokenLimit | None = None, left: bool = False
    ) -> Sequences:
        """Pre-tokenized sequences (whole, non-empty: the edge checked) checked against the model;
        truncated ``left``, each keeps its first id and its last ``max_input_tokens - 1``."""
        flat, counts = seqs.ids, seqs.lengths
        outside = (flat < 0) | (flat >= self.vocab_size)
        if outside.any():
            index = int(np.argmax(outside))
            ends = np.cumsum(counts, dtype=np.int64)
            item = int(np.searchsorted(ends, index, side="right"))
            position = index - int(ends[item] - counts[item])
            reason = f"{flat[index]} is outside the vocabulary [0, {self.vocab_size})"
            raise InvalidInput(Field.INPUT, reason, item, position)
        self._check_lengths(counts, truncate, limit or self.limit)
        if truncate and counts.max() > self.max_input_tokens:
            return self._truncate(flat, counts, left)
        return Sequences(ids=flat.astype(np.int32, copy=False), lengths=counts.astype(np.int32, copy=False))

    def _truncate(self, flat: np.ndarray, counts: np.ndarray, left: bool) -> Sequences:
        """Keep each sequence's first ``max_input_tokens - 1`` ids and its last one (the closing
        special token); ``left``, its first one (the opening special token) and its last ``max_input_tokens - 1``."""
        ends = np.repeat(np.cumsum(counts), counts)
        remaining = ends - np.arange(flat.shape[0])  # 1 at a sequence's last id
        position = np.repeat(counts, counts) - remaining
        if left:
            keep = (position == 0) | (remaining < self.max_input_tokens)
        else:
            keep = (position < self.max_input_tokens - 1) | (remaining == 1)
        kept = np.minimum(counts, self.max_input_tokens)
        return Sequences(ids=flat[keep].astype(np.int32), lengths=kept.astype(np.int32))

    def _check_lengths(self, lengths: np.ndarray, truncate: bool, limit: TokenLimit) -> None:
        too_long = lengths > limit.tokens
        if not truncate and too_long.any():
            index = int(np.argmax(too_long))
            reason = f"{lengths[index]} tokens, longer than {limit.name}; {limit.advice}"
            raise InvalidInput(Field.INPUT, reason, index)


def _exact_tokens(prefix: tokenizers.Encoding) -> int:
    """A prefix's own tokens that the whole text has too: those before its last two words (a cut
    can change how the word it falls in, and whitespace before it, split; each word is at least one
    token, so the whole text has more)."""
    words = prefix.word_ids
    last = max((w for w in words if w is not None), default=None)
    return 0 if last is None else sum(w is not None and w < last - 1 for w in words)


def _truncated(prefix: tokenizers.Encoding, content: int) -> list[int]:
    """A prefix's ids cut to ``content`` tokens of its own between its leading and trailing special
    tokens, as truncation cuts the whole text (``_exact_tokens`` holds at least that many)."""
    ids, special = prefix.ids, prefix.special_tokens_mask
    lead = next((i for i, s in enumerate(special) if not s), len(ids))
    trail = next((i for i, s in enumerate(reversed(special)) if not s), 0)
    return ids[: lead + content] + ids[len(ids) - trail :]


def _configured_copy(backend: tokenizers.Tokenizer, max_length: int | None) -> tokenizers.Tokenizer:
    # tokenizer.json may carry its own padding/truncation (all-MiniLM-L6-v2 pads to 128): reset both.
    copy = tokenizers.Tokenizer.from_str(backend.to_str())
    copy.no_padding()
    if max_length is None:
        copy.no_truncation()
    else:
        copy.enable_truncation(max_length=max_length)
    return copy


def tokenizer_fingerprint(folder: Path) -> str:
    """sha256 over the tokenizer files in ``folder``, sorted by name: each as name, NUL, size, NUL, bytes.

    Clients that pre-tokenize compare it with their own tokenizer's before sending ids.
    """
    digest = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.is_file() and (p.name in _TOKENIZER_FILES or p.suffix == ".model"))
    for path in files:
        data = path.read_bytes()
        digest.update(b"%s\0%d\0" % (path.name.encode(), len(data)))
        digest.update(data)
    return digest.hexdigest()
