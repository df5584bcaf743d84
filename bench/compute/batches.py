"""The batches the ceiling times and the limits build on: texts packed under the server's limits,
bucketed or in order, padded into id and mask tensors before any timing; and the rates and compile
count both report."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bench.compute import inprocess
from bench.tools.report import Spread
from kembed.engine.batcher import BatchShapes

Shape = tuple[int, int]  # rows, length
ShapeOf = Callable[[int, int], Shape]  # (rows, longest text) -> padded shape


@dataclass(frozen=True)
class PaddedBatch:
    ids: torch.Tensor  # [rows, length], padded
    mask: torch.Tensor
    texts: int  # real rows
    real_tokens: int

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def padded_tokens(self) -> int:
        return int(self.ids.numel())

    def to(self, device: torch.device) -> PaddedBatch:
        return PaddedBatch(self.ids.to(device), self.mask.to(device), self.texts, self.real_tokens)


def pack(order: Sequence[int], lengths: Sequence[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Greedy: append texts in ``order`` while rows x longest stays within both limits."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        grown = max(longest, lengths[i])
        if current and (len(current) >= max_rows or (len(current) + 1) * grown > max_tokens):
            batches.append(current)
            current, grown = [], lengths[i]
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches


def bucket_of(length: int, buckets: Sequence[int]) -> int:
    return next((b for b in buckets if b >= length), buckets[-1])


def pack_buckets(lengths: Sequence[int], buckets: Sequence[int], shapes: BatchShapes) -> list[list[int]]:
    """Each text in its bucket; each bucket cut into batches of its most rows."""
    members: dict[int, list[int]] = {b: [] for b in buckets}
    for i, n in enumerate(lengths):
        members[bucket_of(n, buckets)].append(i)
    return [
        items[k : k + shapes.max_rows(b)]
        for b, items in members.items()
        for k in range(0, len(items), shapes.max_rows(b))
    ]


def materialize(
    groups: list[list[int]], shape: ShapeOf, ids: np.ndarray, lengths: np.ndarray, pad_id: int
) -> list[PaddedBatch]:
    """Padded id and mask tensors for each group, built before any timing."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    batches = []
    for group in groups:
        rows, length = shape(len(group), int(lengths[group].max()))
        padded = np.full((rows, length), pad_id, dtype=np.int64)
        mask = np.zeros((rows, length), dtype=np.int64)
        for r, i in enumerate(group):
            padded[r, : lengths[i]] = ids[offsets[i] : offsets[i + 1]]
            mask[r, : lengths[i]] = 1
        batches.append(
            PaddedBatch(torch.from_numpy(padded), torch.from_numpy(mask), len(group), int(lengths[group].sum()))
        )
    return batches


def rates(passes: list[list[float]], weights: Sequence[int]) -> Spread:
    """Weight per second over all passes, ranged over the passes' own rates."""
    per_pass = [sum(weights) / sum(times) for times in passes]
    return Spread(sum(weights) * len(passes) / sum(map(sum, passes)), min(per_pass), max(per_pass))


def compiles() -> int:
    """Frames torch.compile has compiled so far (a rise after warmup is a recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def plan_groups(batching: str, lengths: list[int], loaded: inprocess.InProcessModel) -> tuple[list[list[int]], ShapeOf]:
    """The groups of text indices, and how a group's (rows, longest) becomes its padded shape."""
    if batching == "bucketed":

        def fixed(rows: int, longest: int) -> Shape:
            bucket = bucket_of(longest, loaded.buckets)
            return loaded.shapes.rows_for(rows), bucket

        return pack_buckets(lengths, loaded.buckets, loaded.shapes), fixed
    order = sorted(range(len(lengths)), key=lengths.__getitem__) if batching == "sorted" else range(len(lengths))
    return pack(list(order), lengths, loaded.shapes.sizes[-1], loaded.shapes.max_tokens), _exact


def _exact(rows: int, longest: int) -> Shape:
    return rows, longest
