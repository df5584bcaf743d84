"""Batch shapes and whether they are compiled: pure (no numpy, no torch), so the operator can count
the shapes a server will warm up when it sizes the startup probe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kembed.config import Batching, Settings, Toggle

if TYPE_CHECKING:  # numpy-backed: the operator imports this module without numpy
    from kembed.engine.work import Chunk

# A batch should take a small share of the drain budget: two are in flight and both count in the
# backlog. On CPU 2048 tokens (~0.4 s on two cores) is as efficient per token as 8192 (~2 s).
AUTO_MAX_TOKENS = {"cpu": 2048, "cuda": 16384}


def compiles(settings: Settings, device_type: str) -> bool:
    """Compiled graphs need fixed shapes; the naive baseline has none, so it always runs eager."""
    if settings.batching is Batching.NAIVE:
        return False
    return settings.compile is Toggle.ON or (settings.compile is Toggle.AUTO and device_type == "cuda")


def batch_tokens(settings: Settings, device_type: str) -> int:
    return settings.max_tokens_per_batch or AUTO_MAX_TOKENS.get(device_type, AUTO_MAX_TOKENS["cpu"])


@dataclass(frozen=True)
class BatchShapes:
    """Batch row counts (powers of two up to ``max_batch_size``, capped by tokens), and whether
    batches are padded to exactly those shapes."""

    sizes: tuple[int, ...]
    max_tokens: int
    fixed: bool  # pad to (size, bucket length): CUDA graphs need it; in eager mode it is wasted work

    @classmethod
    def build(cls, max_batch_size: int, max_tokens: int, fixed: bool) -> BatchShapes:
        sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
        if sizes[-1] != max_batch_size:
            sizes.append(max_batch_size)
        return cls(tuple(sizes), max_tokens, fixed)

    def max_rows(self, seq_len: int) -> int:
        """The most rows a batch of this length may have (always at least one)."""
        fitting = [size for size in self.sizes if size * seq_len <= self.max_tokens]
        return fitting[-1] if fitting else self.sizes[0]

    def rows_for(self, n: int, seq_len: int) -> int:
        """The batch size for ``n`` items: the smallest fixed size that holds them, when fixed."""
        if not self.fixed:
            return n
        return next(size for size in self.sizes if size >= n)

    def seq_len_for(self, bucket_length: int, chunks: Sequence[Chunk]) -> int:
        """The batch length: the bucket's when fixed, else the longest item's."""
        if self.fixed:
            return bucket_length
        return max(int(chunk.lengths.max()) for chunk in chunks)

    def grid(self, seq_lens: Sequence[int]) -> list[tuple[int, int]]:
        """Every (seq_len, rows) shape a batch can take: what warmup compiles."""
        return [(seq_len, rows) for seq_len in seq_lens for rows in self.sizes if rows <= self.max_rows(seq_len)]
