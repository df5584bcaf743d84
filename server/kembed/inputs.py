"""Client input to validated token ids: texts are tokenized here, pre-tokenized bytes are checked here.

Everything a client controls is validated before it reaches a shared batch: one bad item must fail
its own request with INVALID_ARGUMENT, never the batch (an out-of-vocabulary id is a device-side
assert on CUDA that poisons the process). Pre-tokenized input is handled with vectorised numpy only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import tokenizers

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


class InputError(ValueError):
    """Bad client input. ``str(err) == f"{field}: {message}"``; the API turns it into INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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
    """The model's fast tokenizer plus the edge validation; safe to call from many threads at once.

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
        max_items: int,
        max_text_chars: int,
    ) -> None:
        self.max_input_tokens = max_input_tokens
        self.vocab_size = vocab_size
        self.max_items = max_items
        self.max_text_chars = max_text_chars
        self.pad_token_id = pad_token_id
        self._full = _configured_copy(backend, max_length=None)
        self._truncating = _configured_copy(backend, max_length=max_input_tokens)
        self._special_tokens = len(self._full.encode("", add_special_tokens=True).ids)

    @classmethod
    def from_transformers(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_input_tokens: int,
        vocab_size: int,
        max_items: int,
        max_text_chars: int,
    ) -> Tokenizer:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer; kembed needs one")
        # Padded positions are masked out, so any in-vocabulary id pads a model without a pad token.
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return cls(
            backend,
            pad_token_id=pad_token_id,
            max_input_tokens=max_input_tokens,
            vocab_size=vocab_size,
            max_items=max_items,
            max_text_chars=max_text_chars,
        )

    def to_json(self) -> str:
        """The tokenizer, serialized for another process (padding and truncation reset)."""
        return str(self._full.to_str())

    def from_texts(self, texts: Sequence[str], truncate: bool) -> Sequences:
        self._check_count("texts", len(texts))
        if max(map(len, texts)) > self.max_text_chars:
            texts = self._cut_to_chars(texts) if truncate else self._refuse_long(texts)
        backend = self._truncating if truncate else self._full
        encodings = backend.encode_batch_fast(list(texts), add_special_tokens=True)
        lengths = np.fromiter(map(len, encodings), dtype=np.int32, count=len(encodings))
        self._check_lengths("texts", lengths, truncate)
        ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=int(lengths.sum()))
        return Sequences(ids=ids, lengths=lengths)

    def _cut_to_chars(self, texts: Sequence[str]) -> list[str]:
        """``truncate`` cuts a text to fit the character limit too: the limit bounds the tokenizer's
        work, and the tokens it drops lie past any model's input limit anyway."""
        limit = self.max_text_chars
        return [text[:limit] if len(text) > limit else text for text in texts]

    def _refuse_long(self, texts: Sequence[str]) -> NoReturn:
        index = next(i for i, text in enumerate(texts) if len(text) > self.max_text_chars)
        raise InputError(f"texts[{index}]", f"{len(texts[index])} characters, more than {self.max_text_chars}")

    def least_lengths(self, texts: Sequence[str]) -> np.ndarray:
        """A lower bound of each text's length in tokens, at a fiftieth of tokenizing's cost: its
        words plus the special tokens. Tokenizers split on whitespace before anything else, so a
        word is at least one token (English prose averages 1.5: the bound is about two thirds of
        the length); capped at the model's limit, where truncation or a refusal ends it."""
        words = np.fromiter((len(text.split()) for text in texts), dtype=np.int64, count=len(texts))
        return np.minimum(words + self._special_tokens, self.max_input_tokens)

    def from_token_bytes(self, ids: bytes, lengths: Sequence[int], truncate: bool) -> Sequences:
        self._check_count("tokens.lengths", len(lengths))
        # int64 holds any uint32 (a client's -1 is 4294967295) and any sum of max_items of them.
        counts = np.asarray(lengths, dtype=np.int64)
        if len(ids) % 4:
            raise InputError("tokens.ids", f"{len(ids)} bytes is not a whole number of int32 ids")
        zero = counts < 1
        if zero.any():
            raise InputError(f"tokens.lengths[{int(np.argmax(zero))}]", "must be at least 1")
        total = int(counts.sum())
        if total * 4 != len(ids):
            raise InputError("tokens.lengths", f"sum to {total} tokens, but tokens.ids holds {len(ids) // 4}")
        flat = np.frombuffer(ids, dtype="<i4")  # a view: nothing allocated before the checks pass
        outside = (flat < 0) | (flat >= self.vocab_size)
        if outside.any():
            index = int(np.argmax(outside))
            raise InputError(f"tokens.ids[{index}]", f"{flat[index]} is outside the vocabulary [0, {self.vocab_size})")
        self._check_lengths("tokens.lengths", counts, truncate)
        if truncate and counts.max() > self.max_input_tokens:
            return self._truncate(flat, counts)
        return Sequences(ids=flat.astype(np.int32), lengths=counts.astype(np.int32))

    def _truncate(self, flat: np.ndarray, counts: np.ndarray) -> Sequences:
        """Keep each sequence's first ``max_input_tokens - 1`` ids and its last one (the closing special token)."""
        ends = np.repeat(np.cumsum(counts), counts)
        remaining = ends - np.arange(flat.shape[0])  # 1 at a sequence's last id
        position = np.repeat(counts, counts) - remaining
        keep = (position < self.max_input_tokens - 1) | (remaining == 1)
        kept = np.minimum(counts, self.max_input_tokens)
        return Sequences(ids=flat[keep].astype(np.int32), lengths=kept.astype(np.int32))

    def _check_count(self, field: str, count: int) -> None:
        if count == 0:
            raise InputError(field, "no inputs")
        if count > self.max_items:
            raise InputError(field, f"{count} inputs, at most {self.max_items} per request")

    def _check_lengths(self, field: str, lengths: np.ndarray, truncate: bool) -> None:
        too_long = lengths > self.max_input_tokens
        if not truncate and too_long.any():
            index = int(np.argmax(too_long))
            raise InputError(
                f"{field}[{index}]",
                f"{lengths[index]} tokens, longer than the model's {self.max_input_tokens}; "
                "set truncate=true to cut it to fit",
            )


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
