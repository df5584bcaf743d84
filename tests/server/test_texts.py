"""One rule for a text without content (``kembed/domain/texts.py``), the same for the server's edges, the
client and the corpus command: it holds no letter, digit, punctuation or symbol, so the bundled
tokenizer turns it into its special tokens alone, as it does the empty text."""

from __future__ import annotations

import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from kembed.client.corpus.reader import Span
from kembed.client.errors import InvalidInput, check_texts
from kembed.domain.texts import EMPTY, NO_CONTENT, has_content, why_not

# The issue's: whitespace, a zero-width space, a control character, a byte order mark.
WITHOUT_CONTENT = [" ", "\u200b", "\t\n", "\x00", "\ufeff", " \u0301 ", "\ue000", "\U000f0000", "\ufffd"]
WITH_CONTENT = ["a", " .", "€", "東", "🚀", "\u200b7", "\U000e0001x", "naïve"]


@pytest.fixture(scope="module")
def tokenizer(bundled_path: Path) -> tokenizers.Tokenizer:
    loaded = tokenizers.Tokenizer.from_file(str(bundled_path / "tokenizer.json"))
    loaded.no_padding()
    loaded.no_truncation()
    return loaded


def test_a_text_without_content_is_what_the_tokenizer_turns_into_nothing(tokenizer: tokenizers.Tokenizer) -> None:
    for text in WITHOUT_CONTENT:
        assert not has_content(text), repr(text)
        assert len(tokenizer.encode(text).ids) == 2, repr(text)  # [CLS] [SEP], as ""
        assert why_not(text) == NO_CONTENT
    for text in WITH_CONTENT:
        assert has_content(text) and why_not(text) is None, repr(text)
    assert why_not("") == EMPTY


def test_every_character_the_tokenizer_drops_is_without_content(tokenizer: tokenizers.Tokenizer) -> None:
    """Over the Basic Multilingual Plane and a sample past it: what the bundled tokenizer turns into
    nothing, the rule calls without content (the reverse need not hold: an unassigned character is
    [UNK] to it)."""
    points = [*range(0x10000), *range(0x10000, sys.maxunicode + 1, 97)]
    chars = [chr(point) for point in points if not 0xD800 <= point < 0xE000]
    dropped = [char for char, ids in zip(chars, tokenizer.encode_batch(chars), strict=True) if len(ids.ids) == 2]
    assert len(dropped) > 1000
    assert [f"U+{ord(c):04X} {unicodedata.category(c)}" for c in dropped if has_content(c)] == []


def test_the_client_refuses_such_a_text_before_sending_it() -> None:
    check_texts(["a", " b"])
    with pytest.raises(InvalidInput, match=r"texts\[1\]: no letter"):
        check_texts(["a", " \t"])


def test_the_corpus_command_writes_such_a_line_as_a_blank_one() -> None:
    span = Span(0, ["alpha", " ", "", "\u200b\t", "beta"])
    assert span.sent == ["alpha", "beta"] and span.blank == 3
    assert span.texts_index(1) == 4
    rows = span.rows(np.ones((2, 3), dtype=np.float32))
    assert rows.any(axis=1).tolist() == [True, False, False, False, True]
