"""Long inputs as chunks (kembed.frontend.chunks): the split against a per-input reference written
plainly, and the token-weighted combination; and the client's plan of a chunked list."""

from __future__ import annotations

import tracemalloc
from itertools import chain

import numpy as np
import pytest

from kembed.client.requests import Limits, Options, plan
from kembed.domain.errors import Field, InvalidInput
from kembed.domain.inputs import Sequences
from kembed.frontend.chunks import Chunking

CHUNKING = Chunking(size=8, head=1, tail=1, max_chunks=4)  # six tokens of its own a chunk
MOST_ITEMS = 64


def sequences(items: list[list[int]]) -> Sequences:
    lengths = np.asarray([len(item) for item in items], dtype=np.int32)
    return Sequences(np.asarray(list(chain.from_iterable(items)), dtype=np.int32), lengths)


def by_hand(item: list[int], chunking: Chunking) -> list[list[int]]:
    """One input's chunks, one at a time: the head, a run of its own tokens, the tail."""
    if len(item) <= chunking.size:
        return [item]
    head, own = item[: chunking.head], item[chunking.head : len(item) - chunking.tail]
    tail = item[len(item) - chunking.tail :]
    return [head + own[i : i + chunking.step] + tail for i in range(0, len(own), chunking.step)]


@pytest.mark.parametrize(("head", "tail"), [(1, 1), (3, 1), (0, 0), (2, 0)])
def test_split_repeats_the_head_and_tail_in_every_chunk(head: int, tail: int) -> None:
    chunking = Chunking(size=8, head=head, tail=tail, max_chunks=8)
    rng = np.random.default_rng(head * 10 + tail)
    items = [rng.integers(1000, 2000, n).tolist() for n in (1, 3, 8, 9, 14, 15, 20, 33, 2)]
    chunks = chunking.split(sequences(items), MOST_ITEMS)
    want = [by_hand(item, chunking) for item in items]
    assert chunks.counts.tolist() == [len(w) for w in want]
    assert chunks.seqs.lengths.tolist() == [len(c) for c in chain.from_iterable(want)]
    assert chunks.seqs.ids.tolist() == list(chain.from_iterable(chain.from_iterable(want)))
    lengths = sequences(items).lengths
    assert chunking.lengths(lengths, chunking.counts(lengths)).tolist() == chunks.seqs.lengths.tolist()
    assert max(chunks.seqs.lengths) <= chunking.size
    assert (chunks.seqs.ids.dtype, chunks.seqs.lengths.dtype) == (np.int32, np.int32)


def test_inputs_that_fit_are_left_as_they_are() -> None:
    seqs = sequences([[101, 5, 102], [101, *range(6), 102]])
    chunks = CHUNKING.split(seqs, MOST_ITEMS)
    assert chunks.seqs is seqs and chunks.counts.tolist() == [1, 1]
    assert chunks.token_counts() is seqs.lengths


def test_the_longest_input_fills_its_chunks() -> None:
    assert CHUNKING.max_tokens == 2 + 4 * 6
    assert CHUNKING.counts(np.array([CHUNKING.max_tokens, CHUNKING.max_tokens + 1])).tolist() == [4, 5]


def test_a_prompt_at_every_chunks_head_shrinks_what_its_chunks_hold() -> None:
    prompted = CHUNKING.with_prompt(4)  # [CLS], four of the prompt's, two of its own, [SEP]
    assert (prompted.step, prompted.max_tokens) == (2, 6 + 4 * 2)
    assert prompted.check(np.array([prompted.max_tokens]), MOST_ITEMS).tolist() == [4]
    with pytest.raises(InvalidInput, match=r"15 tokens need 5 chunks, more than 4 \(max_chunks_per_input\)") as over:
        prompted.check(np.array([3, prompted.max_tokens + 1]), MOST_ITEMS)
    assert (over.value.field, over.value.index) == (Field.INPUT, 1)


@pytest.mark.parametrize(
    ("max_chunks", "most_items", "reason"),
    [(16, 1 << 30, "more than 16 \\(max_chunks_per_input\\)"), (1 << 20, 16, "more than the 16 items a request")],
)
def test_a_split_past_its_chunks_is_refused_before_it_builds_them(
    max_chunks: int, most_items: int, reason: str
) -> None:
    """Issue 45: a prompt of 252 tokens at the head of each chunk of a 256-token model leaves two
    of a text's own; 150 texts of 3,800 tokens were 285,000 chunks whose int64 arrays took 4.3 GiB
    before their count was checked. The count is arithmetic on the inputs' lengths, checked first."""
    chunking = Chunking(size=256, head=1, tail=1, max_chunks=max_chunks).with_prompt(252)
    seqs = Sequences(np.ones(150 * 3800, dtype=np.int32), np.full(150, 3800, dtype=np.int32))
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match=reason):
            chunking.split(seqs, most_items)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak  # arrays of the 150 inputs' lengths, not of the ids (2.3 MB) or chunks


def test_a_chunk_must_hold_a_token_of_its_own() -> None:
    with pytest.raises(ValueError, match="no chunk fits"):
        Chunking(size=2, head=1, tail=1, max_chunks=4)


def test_combine_weights_each_chunk_by_its_tokens() -> None:
    chunks = CHUNKING.split(sequences([[1] * 3, [1] * 14, [1] * 5]), MOST_ITEMS)  # 1, then 8 + 8 (6 + 6 own), then 1
    assert chunks.counts.tolist() == [1, 2, 1] and chunks.seqs.lengths.tolist() == [3, 8, 8, 5]
    chunks = CHUNKING.split(sequences([[1] * 3, [1] * 15, [1] * 5]), MOST_ITEMS)  # 13 own: 6, 6, 1
    assert chunks.seqs.lengths.tolist() == [3, 8, 8, 3, 5]
    rows = np.array([[1, 1], [2, 0], [0, 2], [4, 4], [5, 5]], dtype=np.float32)
    combined = chunks.combine(rows)
    np.testing.assert_allclose(combined[1], (8 * rows[1] + 8 * rows[2] + 3 * rows[3]) / 19)
    np.testing.assert_array_equal(combined[[0, 2]], rows[[0, 4]])
    assert combined.dtype == np.float32
    assert chunks.token_counts().tolist() == [3, 19, 5]


def test_a_chunked_list_is_split_so_every_request_holds_its_chunks() -> None:
    """The client's plan: each input may take the server's most chunks, so a request of 8 items holds 2."""
    limits = Limits(items=8, request_bytes=1 << 20, text_chars=0, chunks=4)
    assert [len(part.request.texts) for part in plan(["a"] * 5, Options(chunk=True), limits)] == [2, 2, 1]
    assert [part.request.chunk for part in plan(["a"] * 5, Options(chunk=True), limits)] == [True] * 3
    assert len(plan(["a"] * 5, Options(), limits)) == 1  # the server does not chunk by default
    by_default = Limits(items=8, request_bytes=1 << 20, text_chars=0, chunks=4, chunk_by_default=True)
    assert len(plan(["a"] * 5, Options(), by_default)) == 3
    assert len(plan(["a"] * 5, Options(truncate=True), by_default)) == 1
    assert not plan(["a"], Options(), limits)[0].request.HasField("chunk")
