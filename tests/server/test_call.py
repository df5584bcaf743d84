"""The front end's domain call: the limits every edge checks while it reads a call, and what a call
knows of itself cheaply (its item count and bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from kembed.domain.errors import Field, InvalidInput
from kembed.domain.inputs import Sequences
from kembed.domain.prompts import PromptChoice
from kembed.frontend.budget import call_weight
from kembed.frontend.call import EmbedCall, Limits, Texts
from kembed.frontend.preparing import INLINE_PREPARE_LIMIT

LIMITS = Limits(max_items=8, max_text_chars=500)


@pytest.mark.parametrize(("count", "reason"), [(0, "no inputs"), (9, "9 inputs, at most 8 per request")])
def test_a_count_outside_the_limit_is_refused_as_the_whole_input(count: int, reason: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        LIMITS.check_count(count)
    assert (caught.value.field, caught.value.index, caught.value.reason) == (Field.INPUT, None, reason)


def test_texts_are_measured_and_the_first_over_long_one_is_located() -> None:
    texts = LIMITS.texts(["ok", "naïve", "x" * 500])
    assert texts.chars == 2 + 5 + 500
    with pytest.raises(InvalidInput) as caught:
        LIMITS.texts(["ok", "x" * 501, "y" * 600])
    assert (caught.value.index, caught.value.reason) == (1, "501 characters, more than 500")


def test_with_truncate_an_over_long_text_is_cut_to_the_limit_not_refused() -> None:
    texts = LIMITS.texts(["ok", "x" * 501, "y" * 600], truncate=True)
    assert list(texts.items) == ["ok", "x" * 500, "y" * 500]
    assert texts.chars == 2 + 500 + 500


def test_too_many_texts_are_refused_before_any_is_measured() -> None:
    class Unmeasurable(str):
        def __len__(self) -> int:
            raise AssertionError("measured a text of a call refused by its count")

    with pytest.raises(InvalidInput, match="9 inputs"):
        LIMITS.texts([Unmeasurable("a")] * 9)


def test_a_call_knows_its_count_and_bytes() -> None:
    texts = EmbedCall(inputs=Texts(["ab", "cde"], 5))
    ids = EmbedCall(inputs=Sequences(np.arange(7, dtype=np.int32), np.array([3, 4], dtype=np.int32)))
    assert (texts.count, texts.nbytes(""), texts.nbytes("q: ")) == (2, 5, 11)
    assert (ids.count, ids.nbytes("")) == (2, 28)
    assert texts.normalize and not texts.truncate and texts.timeout_s is None


def test_a_prompt_weighs_once_per_text() -> None:
    """Issue 45: 1,023 one-character texts and one over-long text after a literal prompt of a
    thousand characters are a 3.7 KB message but a million characters to tokenize; counted without
    the prompt, they were tokenized on the event loop and held at a thousandth of their weight."""
    prompt = "Represent this sentence for retrieving passages: " * 20  # 1,000 characters
    texts = Limits(max_items=1024, max_text_chars=8192).texts(["a"] * 1023 + ["word " * 200])
    call = EmbedCall(inputs=texts, prompt=PromptChoice(text=prompt))
    assert texts.chars <= INLINE_PREPARE_LIMIT < call.nbytes(prompt)  # tokenized off the event loop
    assert call.nbytes(prompt) == texts.chars + 1024 * len(prompt)
    held = call_weight(call.nbytes(prompt), call.count, 384)
    assert held - call_weight(texts.chars, call.count, 384) >= 1024 * len(prompt)  # and reserved
