"""Tokenization and the checks that need the model (kembed.domain.inputs) with the bundled model's real
tokenizer. What the edges check without it (counts, characters, the wire's shapes) is tested with
each edge's mapping (test_call, test_grpc_api, test_openai_api)."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerBase

from kembed.domain.errors import Field, InvalidInput
from kembed.domain.inputs import Sequences, Tokenizer, TokenLimit, tokenizer_fingerprint

VOCAB = 30522
LIMIT = 16
CLS, SEP = 101, 102
LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 10  # ~90 tokens


@pytest.fixture(scope="module")
def tok(hf_tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    return Tokenizer.from_transformers(hf_tokenizer, max_input_tokens=LIMIT, vocab_size=VOCAB)


def sequences(ids: list[int], lengths: list[int]) -> Sequences:
    return Sequences(np.asarray(ids, dtype="<i4"), np.asarray(lengths, dtype=np.int32))


def located(caught: pytest.ExceptionInfo[InvalidInput]) -> tuple[Field, int | None, int | None]:
    error = caught.value
    return error.field, error.index, error.position


def test_invalid_input_locates_the_item_as_data() -> None:
    error = InvalidInput(Field.INPUT, "too long", 3, 12)
    assert (error.field, error.index, error.position, error.reason) == (Field.INPUT, 3, 12, "too long")
    assert error.message == "input[3][12]: too long"  # for logs: each edge names it its own way


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


def test_a_text_over_the_models_limit_is_located(tok: Tokenizer) -> None:
    with pytest.raises(InvalidInput) as caught:
        tok.from_texts(["short", "short", LONG_TEXT], truncate=False)
    assert located(caught) == (Field.INPUT, 2, None)
    # Tokenized from a prefix that holds more than the limit: how many more is not counted.
    advice = "set truncate=true to cut it to fit, or chunk=true to embed it whole as chunks"
    assert caught.value.reason == f"over the model's {LIMIT} tokens; {advice}"


def test_the_special_tokens_around_a_text_are_read_from_the_tokenizer(tok: Tokenizer) -> None:
    assert (tok.head, tok.tail) == (1, 1)  # [CLS] ... [SEP]


def test_a_longer_limit_takes_longer_texts_and_names_itself(
    tok: Tokenizer, hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    """The limit chunking sets: a text up to it is tokenized whole, one past it refused by its name,
    whether tokenized whole or from a prefix."""
    full = hf_tokenizer(LONG_TEXT)["input_ids"]
    roomy = TokenLimit(len(full), "the 4 chunks' tokens", "split it")
    assert tok.from_texts([LONG_TEXT], truncate=False, limit=roomy).ids.tolist() == full
    tight = TokenLimit(len(full) - 1, "the 4 chunks' tokens", "split it")
    with pytest.raises(InvalidInput) as caught:
        tok.from_texts(["short", LONG_TEXT], truncate=False, limit=tight)
    assert located(caught) == (Field.INPUT, 1, None)
    assert caught.value.reason == f"{len(full)} tokens, longer than the 4 chunks' tokens; split it"
    with pytest.raises(InvalidInput) as caught:
        tok.from_texts([LONG_TEXT * 20], truncate=False, limit=tight)  # from a prefix
    assert caught.value.reason == "over the 4 chunks' tokens; split it"


def test_text_truncation_keeps_the_closing_token(tok: Tokenizer, hf_tokenizer: PreTrainedTokenizerBase) -> None:
    seqs = tok.from_texts(["short", LONG_TEXT], truncate=True)
    full = hf_tokenizer(LONG_TEXT)["input_ids"]
    assert seqs.lengths.tolist() == [3, LIMIT]
    assert seqs.ids[3:].tolist() == [*full[: LIMIT - 1], SEP]


def test_left_truncation_keeps_the_opening_token_and_the_texts_tail(
    tok: Tokenizer, hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    text = "a beginning that is cut " + LONG_TEXT + "and the end that is kept"
    full = hf_tokenizer(text)["input_ids"]
    seqs = tok.from_texts(["short", text], truncate=True, left=tok.left("", 0))
    assert seqs.lengths.tolist() == [3, LIMIT]
    assert seqs.ids[3:].tolist() == [CLS, *full[len(full) - (LIMIT - 1) :]]
    assert seqs.ids[:3].tolist() == tok.from_texts(["short"], truncate=True).ids.tolist()  # within the limit: as it is


def test_left_truncation_keeps_the_prompt_at_the_head(tok: Tokenizer, hf_tokenizer: PreTrainedTokenizerBase) -> None:
    """A prompt is a prefix, not the text's start: it stays, and the text's last tokens fill the rest."""
    prompt, text = "query: ", LONG_TEXT + "the end"
    prompt_ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full = hf_tokenizer(text)["input_ids"]
    seqs = tok.from_texts([prompt + text], truncate=True, left=tok.left(prompt, len(prompt_ids)))
    room = LIMIT - 1 - len(prompt_ids)
    assert seqs.ids.tolist() == [CLS, *prompt_ids, *full[len(full) - room :]]


TOKEN_ERRORS = {
    "negative id": ([CLS, 5, SEP, CLS, 7, -1, SEP], [3, 4], (1, 2), "-1 is outside the vocabulary [0, 30522)"),
    "id past the vocabulary": ([CLS, VOCAB, SEP], [3], (0, 1), "30522 is outside"),
    "too long": ([CLS, SEP, *range(1000, 1018), SEP], [2, 19], (1, None), "19 tokens, longer than the model's 16"),
}


@pytest.mark.parametrize("case", TOKEN_ERRORS)
def test_token_errors_are_located_by_item_and_position(tok: Tokenizer, case: str) -> None:
    ids, lengths, (index, position), reason = TOKEN_ERRORS[case]
    with pytest.raises(InvalidInput) as caught:
        tok.from_ids(sequences(ids, lengths), truncate=False)
    assert located(caught) == (Field.INPUT, index, position)
    assert caught.value.reason.startswith(reason)


def test_token_truncation_keeps_first_and_last(tok: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    lengths = [3, 16, 17, 40, 1]
    seqs = [rng.integers(1000, 2000, n).tolist() for n in lengths]
    got = tok.from_ids(sequences(list(chain.from_iterable(seqs)), lengths), truncate=True)
    expected = [s if len(s) <= LIMIT else [*s[: LIMIT - 1], s[-1]] for s in seqs]
    assert got.lengths.tolist() == [3, 16, 16, 16, 1]
    assert got.ids.tolist() == list(chain.from_iterable(expected))
    assert (got.ids.dtype, got.lengths.dtype) == (np.int32, np.int32)


def test_left_token_truncation_keeps_the_first_and_the_last(tok: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    lengths = [3, 16, 17, 40, 1]
    seqs = [rng.integers(1000, 2000, n).tolist() for n in lengths]
    got = tok.from_ids(sequences(list(chain.from_iterable(seqs)), lengths), truncate=True, left=True)
    expected = [s if len(s) <= LIMIT else [s[0], *s[len(s) - (LIMIT - 1) :]] for s in seqs]
    assert got.lengths.tolist() == [3, 16, 16, 16, 1]
    assert got.ids.tolist() == list(chain.from_iterable(expected))


@pytest.mark.parametrize("truncate", [False, True])
def test_ids_round_trip(tok: Tokenizer, truncate: bool) -> None:
    texts = ["hello world", "", "naïve café 東京 🙂", LONG_TEXT if truncate else "def f(x): return x"]
    from_texts = tok.from_texts(texts, truncate=truncate)
    from_ids = tok.from_ids(sequences(from_texts.ids.tolist(), from_texts.lengths.tolist()), truncate=truncate)
    for got, want in ((from_ids.ids, from_texts.ids), (from_ids.lengths, from_texts.lengths)):
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


class Counting:
    """A tokenizer backend that counts the characters it is given to tokenize."""

    def __init__(self, backend: object) -> None:
        self._backend = backend
        self.chars = 0

    def encode(self, text: str, **kwargs: object) -> object:
        self.chars += len(text)
        return self._backend.encode(text, **kwargs)  # type: ignore[attr-defined]

    def encode_batch_fast(self, texts: list[str], **kwargs: object) -> object:
        self.chars += sum(map(len, texts))
        return self._backend.encode_batch_fast(texts, **kwargs)  # type: ignore[attr-defined]


@pytest.fixture
def counted(hf_tokenizer: PreTrainedTokenizerBase) -> tuple[Tokenizer, Counting, Counting]:
    tok = Tokenizer.from_transformers(hf_tokenizer, max_input_tokens=LIMIT, vocab_size=VOCAB)
    full, truncating = Counting(tok._full), Counting(tok._truncating)
    tok._full, tok._truncating = full, truncating  # type: ignore[assignment]
    return tok, full, truncating


# Texts whose tokens per character differ by two orders of magnitude: WordPiece splits punctuation
# into a token a character, a run of 100 letters or more is one [UNK], accents and CJK are split
# and normalized, and whitespace runs are no tokens at all.
HARD_TEXTS = {
    "prose": LONG_TEXT * 10,
    "punctuation": "a." * 5000,
    "one long word": "a" * 5000,
    "long words": ("b" * 150 + " ") * 40,
    "whitespace then words": " " * 300 + LONG_TEXT * 4,
    "accents and CJK": "naïve café 東京タワー 🙂 " * 200,
    "words split mid-way": "unbelievably internationalization " * 100,
    "special tokens in the text": "query [SEP] passage [CLS] " * 100,
}


@pytest.mark.parametrize("name", HARD_TEXTS)
@pytest.mark.parametrize("limit", [LIMIT, 512])
def test_long_texts_are_tokenized_from_a_prefix_exactly(
    hf_tokenizer: PreTrainedTokenizerBase, name: str, limit: int
) -> None:
    """A prefix holding more than the limit gives exactly the tokens the whole text would: truncated,
    the same ids; not truncated, the same verdict (over the limit, or the whole text's ids)."""
    tok = Tokenizer.from_transformers(hf_tokenizer, max_input_tokens=limit, vocab_size=VOCAB)
    text = HARD_TEXTS[name]
    assert len(text) > tok.whole_chars  # the prefix path
    whole = hf_tokenizer(text)["input_ids"]
    truncated = tok.from_texts(["short", text], truncate=True)
    expected = whole if len(whole) <= limit else [*whole[: limit - 1], SEP]
    assert truncated.ids[3:].tolist() == expected
    if len(whole) > limit:
        with pytest.raises(InvalidInput) as caught:
            tok.from_texts(["short", text], truncate=False)
        assert located(caught) == (Field.INPUT, 1, None)
    else:
        assert tok.from_texts([text], truncate=False).ids.tolist() == whole


@pytest.mark.parametrize("name", HARD_TEXTS)
@pytest.mark.parametrize("limit", [LIMIT, 512])
@pytest.mark.parametrize("prompt", ["", "query: "])
def test_long_texts_truncated_left_are_tokenized_from_a_suffix_exactly(
    hf_tokenizer: PreTrainedTokenizerBase, name: str, limit: int, prompt: str
) -> None:
    """A suffix holding what the limit keeps gives exactly the ids the whole text, cut left, would."""
    tok = Tokenizer.from_transformers(hf_tokenizer, max_input_tokens=limit, vocab_size=VOCAB)
    text = HARD_TEXTS[name]
    assert len(text) > tok.whole_chars  # the suffix path
    whole = hf_tokenizer(prompt + text)["input_ids"]
    kept = 1 + tok.count(prompt)
    expected = whole if len(whole) <= limit else [*whole[:kept], *whole[len(whole) - (limit - kept) :]]
    truncated = tok.from_texts(["short", prompt + text], truncate=True, left=tok.left(prompt, tok.count(prompt)))
    assert truncated.ids[truncated.lengths[0] :].tolist() == expected


def test_the_work_of_a_text_is_bounded_by_the_model_limit_not_its_length(
    counted: tuple[Tokenizer, Counting, Counting],
) -> None:
    """``"a." * 49999`` is one whitespace word and 100,000 WordPiece tokens: it is refused, or
    truncated, after tokenizing a prefix a few times the limit, not its 100,000 characters."""
    tok, full, truncating = counted
    attack = ["a." * 49_999] * 10  # 1 MB
    with pytest.raises(InvalidInput) as caught:
        tok.from_texts(attack, truncate=False)
    assert located(caught) == (Field.INPUT, 0, None)
    assert full.chars + truncating.chars == 10 * (LIMIT + 1)  # one prefix each, as long as the limit
    full.chars = truncating.chars = 0
    assert tok.from_texts(attack, truncate=True).lengths.tolist() == [LIMIT] * 10
    assert full.chars + truncating.chars == 10 * (LIMIT + 1)
    full.chars = truncating.chars = 0
    document = LONG_TEXT * 250  # 110,000 characters of prose
    assert tok.from_texts([document], truncate=True).lengths.tolist() == [LIMIT]
    assert full.chars + truncating.chars <= 4 * tok.whole_chars  # a prefix or two a few times the limit
    full.chars = truncating.chars = 0
    assert tok.from_texts([*attack, document], truncate=True, left=tok.left("", 0)).lengths.tolist() == [LIMIT] * 11
    assert full.chars + truncating.chars <= 10 * (LIMIT + 1) + 4 * tok.whole_chars  # suffixes, as the prefixes


def test_an_earlier_text_over_the_limit_is_named_before_a_later_long_one(tok: Tokenizer) -> None:
    with pytest.raises(InvalidInput) as caught:
        tok.from_texts(["ok", "a. " * 10, LONG_TEXT], truncate=False)  # 30 characters, 22 tokens
    assert located(caught) == (Field.INPUT, 1, None)
    assert caught.value.reason.startswith("22 tokens, longer than")
