"""Edge validation and tokenization (kembed.inputs) with the bundled model's real tokenizer."""

from __future__ import annotations

import shutil
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerBase

from kembed.inputs import InputError, Sequences, Tokenizer, tokenizer_fingerprint
from kembed.v1 import embedder_pb2

VOCAB = 30522
LIMIT = 16
CLS, SEP = 101, 102
LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 10  # ~90 tokens


@pytest.fixture(scope="module")
def tok(hf_tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    return Tokenizer.from_transformers(
        hf_tokenizer, max_input_tokens=LIMIT, vocab_size=VOCAB, max_items=8, max_text_chars=500
    )


def as_bytes(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def raises(field: str, *fragments: str) -> pytest.RaisesExc[InputError]:
    """Expect an InputError on `field` whose message has every fragment."""
    return pytest.raises(InputError, match="^" + "".join(f"(?=.*{f})" for f in (field, *fragments)))


def test_input_error_format() -> None:
    err = InputError("texts[3]", "too long")
    assert (str(err), err.field, err.message) == ("texts[3]: too long", "texts[3]", "too long")
    assert isinstance(err, ValueError)


def test_sequences_offsets() -> None:
    seqs = Sequences(ids=np.arange(9, dtype=np.int32), lengths=np.array([2, 3, 4], dtype=np.int32))
    assert seqs.count == 3
    assert seqs.offsets.tolist() == [0, 2, 5]
    assert seqs.offsets.dtype == np.int64


def test_texts_tokenize_with_special_tokens(tok: Tokenizer) -> None:
    seqs = tok.from_texts(["hello world", "", "  \t hello   "], truncate=False)
    assert (seqs.ids.dtype, seqs.lengths.dtype) == (np.int32, np.int32)
    assert seqs.lengths.tolist() == [4, 2, 3]
    assert seqs.ids.tolist() == [CLS, 7592, 2088, SEP, CLS, SEP, CLS, 7592, SEP]
    assert tok.pad_token_id == 0


@pytest.mark.parametrize(
    ("texts", "field", "fragments"),
    [
        ([], "texts", ["no inputs"]),
        (["a"] * 9, "texts", ["9 inputs", "8"]),
        (["ok", "x" * 501, "y" * 600], r"texts\[1\]", ["501 characters", "500"]),
        (["short", "short", LONG_TEXT], r"texts\[2\]", ["92 tokens", "16", "truncate=true"]),
    ],
)
def test_text_errors(tok: Tokenizer, texts: list[str], field: str, fragments: list[str]) -> None:
    with raises(field, *fragments):
        tok.from_texts(texts, truncate=False)


def test_text_truncation_keeps_the_closing_token(tok: Tokenizer, hf_tokenizer: PreTrainedTokenizerBase) -> None:
    seqs = tok.from_texts(["short", LONG_TEXT], truncate=True)
    full = hf_tokenizer(LONG_TEXT)["input_ids"]
    assert seqs.lengths.tolist() == [3, LIMIT]
    assert seqs.ids[3:].tolist() == [*full[: LIMIT - 1], SEP]


def test_truncation_cuts_a_text_over_the_character_limit_too(hf_tokenizer: PreTrainedTokenizerBase) -> None:
    """A text over the character limit is refused (above), or with truncate cut to it: here to 50
    characters, ten words, well within the model's tokens."""
    tok = Tokenizer.from_transformers(
        hf_tokenizer, max_input_tokens=512, vocab_size=VOCAB, max_items=8, max_text_chars=50
    )
    seqs = tok.from_texts(["short", "word " * 20], truncate=True)
    assert seqs.lengths.tolist() == [3, 12]  # [CLS] ten words [SEP]
    assert seqs.ids.tolist() == tok.from_texts(["short", "word " * 10], truncate=False).ids.tolist()


@pytest.mark.parametrize(
    ("ids", "lengths", "field", "fragments"),
    [
        ([], [], "tokens.lengths", ["no inputs"]),
        ([CLS] * 9, [1] * 9, "tokens.lengths", ["9 inputs"]),
        (b"\x01\x00\x00\x00\x02", [1], "tokens.ids", ["5 bytes"]),
        ([CLS, SEP, CLS, SEP], [2, 3], "tokens.lengths", ["sum to 5", "holds 4"]),
        ([CLS, SEP, CLS, SEP], [2, 2, 0], r"tokens.lengths\[2\]", ["at least 1"]),
        ([CLS, 5, SEP, CLS, 7, -1, SEP], [3, 4], r"tokens.ids\[5\]", ["-1 is outside", "30522"]),
        ([CLS, VOCAB, SEP], [3], r"tokens.ids\[1\]", ["30522 is outside"]),
        ([CLS, SEP, *range(1000, 1018), SEP], [2, 19], r"tokens.lengths\[1\]", ["19 tokens", "16", "truncate=true"]),
    ],
)
def test_token_errors(tok: Tokenizer, ids: list[int] | bytes, lengths: list[int], field: str, fragments: list[str]):
    data = ids if isinstance(ids, bytes) else as_bytes(ids)
    with raises(field, *fragments):
        tok.from_token_bytes(data, lengths, truncate=False)


def test_bogus_length_fails_fast_without_allocating(tok: Tokenizer) -> None:
    # A client's -1 arrives as 4294967295 through the proto's uint32 field.
    message = embedder_pb2.TokenIds(ids=as_bytes([CLS, SEP, CLS, SEP]), lengths=[2**32 - 1, 2**32 - 1, 2])
    tracemalloc.start()
    with raises("tokens.lengths", "sum to 8589934592"):
        tok.from_token_bytes(message.ids, message.lengths, truncate=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20  # nothing sized by the bogus lengths was allocated


def test_token_truncation_keeps_first_and_last(tok: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    lengths = [3, 16, 17, 40, 1]
    seqs = [rng.integers(1000, 2000, n).tolist() for n in lengths]
    got = tok.from_token_bytes(as_bytes(list(chain.from_iterable(seqs))), lengths, truncate=True)
    expected = [s if len(s) <= LIMIT else [*s[: LIMIT - 1], s[-1]] for s in seqs]
    assert got.lengths.tolist() == [3, 16, 16, 16, 1]
    assert got.ids.tolist() == list(chain.from_iterable(expected))
    assert (got.ids.dtype, got.lengths.dtype) == (np.int32, np.int32)


@pytest.mark.parametrize("truncate", [False, True])
def test_bytes_round_trip(tok: Tokenizer, truncate: bool) -> None:
    texts = ["hello world", "", "naïve café 東京 🙂", LONG_TEXT if truncate else "def f(x): return x"]
    from_texts = tok.from_texts(texts, truncate=truncate)
    message = embedder_pb2.TokenIds(ids=from_texts.ids.astype("<i4").tobytes(), lengths=from_texts.lengths.tolist())
    from_bytes = tok.from_token_bytes(message.ids, message.lengths, truncate=truncate)
    for got, want in ((from_bytes.ids, from_texts.ids), (from_bytes.lengths, from_texts.lengths)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_concurrent_calls_agree(tok: Tokenizer) -> None:
    # Truncating and non-truncating calls interleaved: each must see its own configuration.
    jobs = [([LONG_TEXT, f"text {i}"], True) if i % 2 else ([f"text {i}"] * 3, False) for i in range(64)]
    expected = [tok.from_texts(texts, truncate) for texts, truncate in jobs]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: tok.from_texts(*job), jobs))
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g.ids, e.ids)
        np.testing.assert_array_equal(g.lengths, e.lengths)


def test_fingerprint_covers_tokenizer_files_only(bundled_path: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "vocab.txt", "config.json"):
        shutil.copy(bundled_path / name, tmp_path / name)
    before = tokenizer_fingerprint(tmp_path)
    assert len(before) == 64
    (tmp_path / "config.json").write_text("{}")
    assert tokenizer_fingerprint(tmp_path) == before
    with (tmp_path / "vocab.txt").open("a") as f:
        f.write("extra\n")
    assert tokenizer_fingerprint(tmp_path) != before


LOWER_BOUND_TEXTS = [
    "hello world",
    "Tokenizers split on whitespace first, then into word pieces: antidisestablishmentarianism.",
    "Punctuation!!! splits... words, (brackets) and 'quotes' too; e.g. U.S.A. and 3.14159.",
    "   leading, trailing   and  repeated   spaces   ",
    "tabs\tand\nnewlines\r\nbetween words",
    "Ünïcödé ĉàfé naïve façade — em dashes – and “curly quotes”",
    "東京は日本の首都です。中文没有空格。",
    "emoji 🙂🚀 and symbols ∑∫√ ≠ ≤",
    "def f(x):\n    return {k: v for k, v in x.items() if v is not None}",
    "a",
    "x" * 400,
]


def test_least_lengths_bound_the_real_lengths_from_below(tok: Tokenizer) -> None:
    real = tok.from_texts(LOWER_BOUND_TEXTS[:8], truncate=True).lengths
    real = np.concatenate([real, tok.from_texts(LOWER_BOUND_TEXTS[8:], truncate=True).lengths])
    least = tok.least_lengths(LOWER_BOUND_TEXTS)
    assert (least <= real).all(), list(zip(LOWER_BOUND_TEXTS, least, real, strict=True))
    assert (least >= 3).sum() >= 8  # and they are not trivial: words count
    assert least.max() <= LIMIT
