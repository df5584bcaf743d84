"""Long inputs as chunks (kembed.frontend.chunks): the split against a per-input reference written
plainly, and the token-weighted combination."""

from __future__ import annotations

from itertools import chain

import numpy as np
import pytest

from kembed.frontend.chunks import Chunking
from kembed.inputs import Sequences

CHUNKING = Chunking(size=8, head=1, tail=1, max_chunks=4)  # six tokens of its own a chunk


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
    chunks = chunking.split(sequences(items))
    want = [by_hand(item, chunking) for item in items]
    assert chunks.counts.tolist() == [len(w) for w in want]
    assert chunks.seqs.lengths.tolist() == [len(c) for c in chain.from_iterable(want)]
    assert chunks.seqs.ids.tolist() == list(chain.from_iterable(chain.from_iterable(want)))
    assert chunking.lengths(sequences(items).lengths).tolist() == chunks.seqs.lengths.tolist()
    assert max(chunks.seqs.lengths) <= chunking.size
    assert (chunks.seqs.ids.dtype, chunks.seqs.lengths.dtype) == (np.int32, np.int32)


def test_inputs_that_fit_are_left_as_they_are() -> None:
    seqs = sequences([[101, 5, 102], [101, *range(6), 102]])
    chunks = CHUNKING.split(seqs)
    assert chunks.seqs is seqs and chunks.counts.tolist() == [1, 1]
    assert chunks.token_counts() is seqs.lengths


def test_the_longest_input_fills_its_chunks() -> None:
    assert CHUNKING.max_tokens == 2 + 4 * 6
    assert CHUNKING.counts(np.array([CHUNKING.max_tokens, CHUNKING.max_tokens + 1])).tolist() == [4, 5]


def test_a_chunk_must_hold_a_token_of_its_own() -> None:
    with pytest.raises(ValueError, match="no chunk fits"):
        Chunking(size=2, head=1, tail=1, max_chunks=4)


def test_combine_weights_each_chunk_by_its_tokens() -> None:
    chunks = CHUNKING.split(sequences([[1] * 3, [1] * 14, [1] * 5]))  # 1, then 8 + 8 (6 + 6 own), then 1
    assert chunks.counts.tolist() == [1, 2, 1] and chunks.seqs.lengths.tolist() == [3, 8, 8, 5]
    chunks = CHUNKING.split(sequences([[1] * 3, [1] * 15, [1] * 5]))  # 13 own: 6, 6, 1
    assert chunks.seqs.lengths.tolist() == [3, 8, 8, 3, 5]
    rows = np.array([[1, 1], [2, 0], [0, 2], [4, 4], [5, 5]], dtype=np.float32)
    combined = chunks.combine(rows)
    np.testing.assert_allclose(combined[1], (8 * rows[1] + 8 * rows[2] + 3 * rows[3]) / 19)
    np.testing.assert_array_equal(combined[[0, 2]], rows[[0, 4]])
    assert combined.dtype == np.float32
    assert chunks.token_counts().tolist() == [3, 19, 5]
