"""Shape math, in one place: the bucket ladder (which bucket an item goes to, what it costs padded
to it), batch shapes and whether they are compiled. Shared by the front ends (a request's cost),
the engine (routing, batching) and the operator (which counts the shapes a server will warm up to
size its startup probe). The operator has no numpy: the functions that work on arrays import it
where they run.

:class:`Queueing` is the only reader of ``KEMBED_BATCHING``: the naive baseline (an ablation that
shows what length buckets are worth) differs from the token-bucket batcher only in the fields it
sets there, which the batcher, warmup and admission apply without knowing the mode.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kembed.config.settings import Settings
from kembed.config.values import Batching, Graphs, Toggle

if TYPE_CHECKING:
    import numpy as np

# A batch should take a small share of the drain budget: two are in flight and both count in the
# backlog. On CPU 2048 tokens (~0.4 s on two cores) is as efficient per token as 8192 (~2 s).
AUTO_MAX_TOKENS = {"cpu": 2048, "cuda": 16384}


def clip_buckets(bucket_lengths: Sequence[int], max_input_tokens: int) -> list[int]:
    """Bucket lengths below the model's limit, plus the limit itself as the last bucket."""
    return [length for length in bucket_lengths if length < max_input_tokens] + [max_input_tokens]


def bucket_of(lengths: np.ndarray, bucket_lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Each length's bucket: the index of the smallest bucket that holds it (the last for longer)."""
    import numpy as np

    ladder = np.asarray(bucket_lengths)
    return np.minimum(np.searchsorted(ladder, lengths, side="left"), len(ladder) - 1)


def padded_lengths(lengths: np.ndarray, bucket_lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Each length padded to its bucket: summed per request, the unit admission counts."""
    import numpy as np

    return np.asarray(bucket_lengths)[bucket_of(lengths, bucket_lengths)]


# Up to this many items, a request's padded cost is summed in Python: numpy's calls on a few
# elements cost more than the arithmetic (6 µs against under 1 for one item).
FEW_ITEMS = 8


def padded_tokens(lengths: np.ndarray, bucket_lengths: Sequence[int]) -> int:
    """What items of these lengths cost once each is padded to its bucket (``bucket_lengths`` a
    list, ascending): the sum of :func:`padded_lengths`."""
    if len(lengths) > FEW_ITEMS:
        return int(padded_lengths(lengths, bucket_lengths).sum())
    last = len(bucket_lengths) - 1
    return sum(bucket_lengths[min(bisect.bisect_left(bucket_lengths, length), last)] for length in lengths.tolist())


# Buckets drain oldest first, each taking its items young and old: a request whose bucket is
# about to go waits next to nothing, one that just missed its bucket's turn waits for the whole
# backlog plus the younger items that ride along in the batches before its turn, about twice the
# drain time (measured: accepted p95 1.7x the drain estimate at 4x overload). One queue in arrival
# order waits the drain time.
BUCKETED_WAIT_SPREAD = 2.0


@dataclass(frozen=True)
class Queueing:
    """How queued items become batches. Token buckets (the default): items queue by length bucket
    and batches are formed by the batcher's rules, in fixed shapes when compiled, else packed by
    length across neighbouring buckets. The naive baseline (``KEMBED_BATCHING=naive``): one queue
    (a single bucket at the model's limit) in arrival order, padded to its longest, never compiled."""

    one_queue: bool  # naive
    compile: Toggle
    graphs: Graphs = Graphs.CAPTURE

    @classmethod
    def of(cls, settings: Settings) -> Queueing:
        return cls(one_queue=settings.batching is Batching.NAIVE, compile=settings.compile, graphs=settings.graphs)

    def ladder(self, bucket_lengths: Sequence[int], max_input_tokens: int) -> list[int]:
        """The bucket lengths served with a model that takes at most ``max_input_tokens``."""
        return [max_input_tokens] if self.one_queue else clip_buckets(bucket_lengths, max_input_tokens)

    def compiles(self, device_type: str) -> bool:
        """Whether batches take fixed shapes, each with its compiled graph: on CUDA unless off, on a CPU
        only for ``KEMBED_GRAPHS=static`` with ``KEMBED_COMPILE=on`` (a CPU otherwise compiles, if at
        all, one forward for the packed shapes: kembed.engine.cpu_compile). One queue padded to its
        longest has no fixed shapes."""
        if self.one_queue or self.compile is Toggle.OFF:
            return False
        if device_type == "cpu":
            return self.compile is Toggle.ON and self.graphs is Graphs.STATIC
        return self.compile is Toggle.ON or device_type == "cuda"

    def compiles_forward(self, device_type: str) -> bool:
        """Whether a CPU compiles one forward for its packed batches, measured against eager when auto
        (kembed.engine.cpu_compile)."""
        return device_type == "cpu" and self.compile is not Toggle.OFF and self.packs(device_type)

    def packs(self, device_type: str) -> bool:
        """Whether eager batches are packed by length from neighbouring buckets (see the batcher)."""
        return not self.one_queue and not self.compiles(device_type)

    @property
    def wait_spread(self) -> float:
        """The longest wait behind a backlog, in drain times: what admission budgets."""
        return 1.0 if self.one_queue else BUCKETED_WAIT_SPREAD


def compiles(settings: Settings, device_type: str) -> bool:
    """Whether a server with these settings compiles its batch shapes on this device."""
    return Queueing.of(settings).compiles(device_type)


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

    def rows_for(self, n: int) -> int:
        """The batch size for ``n`` items: the smallest fixed size that holds them, when fixed."""
        if not self.fixed:
            return n
        return next(size for size in self.sizes if size >= n)

    def seq_len_for(self, bucket_length: int, longest: int) -> int:
        """The batch length: the bucket's when fixed, else its longest item's."""
        return bucket_length if self.fixed else longest

    def grid(self, seq_lens: Sequence[int]) -> list[tuple[int, int]]:
        """Every (seq_len, rows) shape a batch can take: what warmup compiles."""
        return [(seq_len, rows) for seq_len in seq_lens for rows in self.sizes if rows <= self.max_rows(seq_len)]
