"""Long inputs embedded as chunks of the model's length (``chunk``): pure functions of token ids.

An input longer than the model's limit is split into chunks of at most ``size`` tokens. Every chunk
starts with the input's first ``head`` ids (its leading special tokens, [CLS]; a prompt's tokens
would join them) and ends with its last ``tail`` ids ([SEP]), so each is an input as the model was
trained on; the content between is cut into runs of ``size - head - tail`` tokens. An input that fits
is one chunk, itself. Each chunk is an item like any other (buckets, budgets and admission count it),
and an input's vector is its chunks' pooled vectors averaged, each weighted by its tokens, as vLLM's
chunked processing does: for mean pooling, that is the mean over every token the chunks computed.
Why the front end does this, and not the engine: docs/decisions/chunked-inputs.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kembed.domain.errors import Field, InvalidInput
from kembed.domain.inputs import Sequences


@dataclass(frozen=True, slots=True)
class Chunking:
    """How inputs are split: chunks of at most ``size`` tokens, each repeating the input's first
    ``head`` and last ``tail`` ids, at most ``max_chunks`` of them per input."""

    size: int
    head: int
    tail: int
    max_chunks: int

    def __post_init__(self) -> None:
        if self.step < 1 or self.max_chunks < 1:
            raise ValueError(f"no chunk fits: {self}")

    @property
    def step(self) -> int:
        """An input's own tokens in each chunk."""
        return self.size - self.head - self.tail

    @property
    def max_tokens(self) -> int:
        """The longest input, special tokens included, that ``max_chunks`` chunks hold."""
        return self.head + self.tail + self.max_chunks * self.step

    def with_prompt(self, tokens: int) -> Chunking:
        """Chunks that each start with a prompt's ``tokens`` too: the step shrinks by as many, and so
        does what ``max_chunks`` chunks hold of an input's own tokens."""
        return replace(self, head=self.head + tokens)

    def check(self, lengths: np.ndarray, most_items: int) -> np.ndarray:
        """How many chunks each input of these lengths is split into, refused (naming the input)
        past ``max_chunks`` or, all together, past ``most_items``: arithmetic on the lengths alone,
        so nothing sized by the chunks is built for a call that is refused."""
        counts = self.counts(lengths)
        if (over := counts > self.max_chunks).any():
            index = int(np.argmax(over))
            reason = f"{lengths[index]} tokens need {counts[index]} chunks, more than {self.max_chunks}"
            raise InvalidInput(Field.INPUT, f"{reason} (max_chunks_per_input): split it", index)
        if (total := int(counts.sum())) > most_items:
            reason = f"needs at least {total} chunks, more than the {most_items} items a request holds"
            raise InvalidInput(Field.INPUT, f"{reason} (max_batch_items): split it")
        return counts

    def counts(self, lengths: np.ndarray) -> np.ndarray:
        """How many chunks each input of these lengths is split into."""
        lengths = np.asarray(lengths, dtype=np.int64)
        content = lengths - self.head - self.tail
        return np.where(lengths <= self.size, 1, -(-content // self.step))

    def lengths(self, lengths: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Every chunk's length, each input's chunks in order (``counts`` of them: :meth:`check`'s),
        full chunks, then what is left."""
        lengths = np.asarray(lengths, dtype=np.int64)
        chunks = np.repeat(np.minimum(lengths, self.size), counts)
        split = counts > 1
        left = lengths[split] - (counts[split] - 1) * self.step  # the last chunk's own tokens and the specials
        chunks[(np.cumsum(counts) - 1)[split]] = left
        return chunks

    def split(self, seqs: Sequences, most_items: int) -> Chunks:
        """The inputs as chunks; inputs that fit the model stay as they are. Refused as :meth:`check`
        refuses, before any array of the chunks is built."""
        counts = self.check(seqs.lengths, most_items)
        if not (seqs.lengths > self.size).any():
            return Chunks.whole(seqs)
        lengths = self.lengths(seqs.lengths, counts)
        first = np.cumsum(counts) - counts  # each input's first chunk
        nth = np.arange(lengths.shape[0]) - np.repeat(first, counts)  # each chunk's place in its input
        # Per id of the chunks: its chunk's length, its place in its chunk, its input's length and offset.
        chunk_length = np.repeat(lengths, lengths)
        place = np.arange(chunk_length.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        input_length = np.repeat(np.repeat(seqs.lengths.astype(np.int64), counts), lengths)
        offset = np.repeat(np.repeat(seqs.offsets, counts), lengths)
        source = np.where(
            place < self.head,
            place,
            np.where(
                place >= chunk_length - self.tail,
                input_length - (chunk_length - place),  # the input's last ids
                place + np.repeat(nth, lengths) * self.step,
            ),
        )
        chunked = Sequences(ids=seqs.ids[offset + source].astype(np.int32), lengths=lengths.astype(np.int32))
        return Chunks(chunked, counts)


@dataclass(frozen=True, slots=True)
class Chunks:
    """A call's inputs as the items the engine computes: ``seqs`` holds every chunk, ``counts`` how
    many of them are each input's (in order)."""

    seqs: Sequences
    counts: np.ndarray  # int [inputs]

    @classmethod
    def whole(cls, seqs: Sequences) -> Chunks:
        """Each input one chunk: itself."""
        return cls(seqs, np.ones(seqs.count, dtype=np.int64))

    @property
    def inputs(self) -> int:
        return int(self.counts.shape[0])

    def token_counts(self) -> np.ndarray:
        """Each input's tokens: its chunks' together."""
        if self.seqs.count == self.inputs:
            return self.seqs.lengths
        return np.add.reduceat(self.seqs.lengths, self._firsts()).astype(np.int32)

    def combine(self, rows: np.ndarray) -> np.ndarray:
        """Each input's vector from its chunks' pooled ``rows`` (unnormalised): their mean weighted
        by each chunk's tokens, accumulated in float64."""
        if self.seqs.count == self.inputs:
            return rows
        weights = self.seqs.lengths.astype(np.float64)[:, None]
        firsts = self._firsts()
        sums = np.add.reduceat(rows * weights, firsts, axis=0)
        return (sums / np.add.reduceat(weights, firsts, axis=0)).astype(np.float32)

    def _firsts(self) -> np.ndarray:
        return np.cumsum(self.counts) - self.counts
