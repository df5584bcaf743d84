"""The loaded model and its serving plan (a :class:`ModelRunner`): the batch shapes it serves and
how a batch is computed. :mod:`kembed.engine.warmup` makes one; :mod:`kembed.engine.worker` runs it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kembed.config.settings import Settings
from kembed.config.values import Warmup
from kembed.domain.inputs import Sequences
from kembed.engine import cpu_compile
from kembed.engine.buckets import route
from kembed.engine.cpu_compile import Served
from kembed.engine.graphs import ShapeGuard, UnplannedShapeError
from kembed.engine.model import EmbeddingModel
from kembed.engine.precision import Precision
from kembed.engine.units import Batch, Chunk, Outcome
from kembed.policy.shapes import BatchShapes, Queueing, batch_tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What the loaded model is served with: bucket lengths and batch shapes, and the shapes warmed up."""

    bucket_lengths: list[int]
    shapes: BatchShapes
    compiled: bool
    packed: bool  # eager batches packed by length across neighbouring buckets
    warmup: Warmup
    lanes: int = 1  # batches computed at once (CPU, eager), each on its share of the compute threads

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """(seq_len, rows) in warmup order: see :func:`warmup_order`."""
        # Compiled, every shape needs its graph before serving: sealing refuses shapes not warmed.
        if self.compiled or self.warmup is Warmup.GRID:
            return warmup_order(self.shapes.grid(self.bucket_lengths))
        return warmup_order([(length, self.shapes.max_rows(length)) for length in self.bucket_lengths])


LoadModel = Callable[[Settings], EmbeddingModel]


def make_plan(settings: Settings, model: EmbeddingModel) -> Plan:
    device, queueing = model.info.device.type, Queueing.of(settings)
    compiled = queueing.compiles(device)
    lengths = queueing.ladder(settings.buckets, model.info.max_input_tokens)
    shapes = BatchShapes.build(settings.max_batch_size, batch_tokens(settings, device), fixed=compiled)
    lanes = compute_lanes(settings, device, compiled)
    return Plan(lengths, shapes, compiled, queueing.packs(device), settings.warmup, lanes)


def compute_lanes(settings: Settings, device_type: str, compiled: bool) -> int:
    """Batches computed at once. On a CPU in eager mode, one per CPU by default: a compute thread
    that serving preempts then stalls its own batch alone, where one batch on every thread waits for
    the slowest at each operator (docs/decisions/compute-lanes.md). Compiled graphs replay on the
    thread that captured them, and a GPU computes one batch at a time anyway."""
    if compiled or device_type != "cpu":
        return 1
    return settings.compute_lanes or max(1, int(settings.cpus()))


def warmup_order(shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(seq_len, rows) shapes, largest first, one-row shapes last.

    The first call of the dynamic compile (graphs=capture) sets the size hints inductor tunes its
    kernels for, so it should be the largest batch, not the smallest; dynamo specialises one-row
    batches into a graph of their own, so a one-row shape first would leave the general graph's hints
    to whichever shape came second. Captured first, the largest graph also sizes the shared memory pool
    the smaller ones then reuse.
    """
    return sorted(shapes, key=lambda shape: (shape[1] == 1, -shape[0] * shape[1], -shape[0]))


def is_fatal(error: BaseException) -> bool:
    """A CUDA error poisons the context: nothing on this device can be trusted afterwards."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and "CUDA error" in str(error)


class ModelRunner:
    """The loaded model and its serving plan: warmup and batch compute, on the worker thread."""

    def __init__(
        self,
        model: EmbeddingModel,
        plan: Plan,
        graphs: ShapeGuard | None = None,
        why: str = "as loaded",
        served: Served = cpu_compile.AS_LOADED,
    ) -> None:
        self.model = model
        self.plan = plan
        self.graphs = graphs  # when compiled: which shapes have a graph, sealed after warmup
        self.why = why  # why the model serves in its dtype
        self.served = served  # which forward serves (eager, compiled, graphs), and why
        self.warmup_tokens = 0  # of the largest batch of each bucket: what seeds the service rate
        self.warmup_seconds = 0.0
        self.overhead_tokens = 0.0  # packed: what a batch costs beyond its padded tokens

    def adopt(self, model: EmbeddingModel, served: Served) -> None:
        """Serve with ``model`` (the same weights, another forward) from the next batch on: each
        lane reads ``self.model`` as it computes a batch: the weights and the vectors are the same."""
        self.model = model
        self.served = served

    @property
    def precision(self) -> Precision:
        return Precision(str(self.model.info.dtype).removeprefix("torch."), self.why)

    def timed(self, ids: torch.Tensor, mask: torch.Tensor, repeats: int, beat: Callable[[], None]) -> float:
        """The fastest of ``repeats`` runs of a batch, in seconds (the first pays one-off costs:
        allocations, or a graph's compile and capture)."""
        fastest = math.inf
        for _ in range(repeats):
            started = time.perf_counter()
            self._pooled(ids, mask)
            fastest = min(fastest, time.perf_counter() - started)
            beat()
        return fastest

    def embed(self, seqs: Sequences) -> np.ndarray:
        """Pooled rows of sequences, in one batch padded to the longest."""
        (routed,) = route(seqs, [int(seqs.lengths.max())], self.model.info.pad_token_id)
        mask = np.arange(routed.ids.shape[1])[None, :] < routed.lengths[:, None]
        return self._pooled(torch.from_numpy(routed.ids), torch.from_numpy(mask.astype(np.int32)))

    def compute(self, chunks: list[Chunk], seq_len: int) -> list[Outcome]:
        """Compute chunks as one batch; if that fails, each half on its own, so only the
        offending request fails. Fatal device errors propagate."""
        if not chunks:
            return []
        items = sum(chunk.items for chunk in chunks)
        batch = Batch(chunks, seq_len, self.plan.shapes.rows_for(items))
        try:
            ids, mask = batch.assemble(self.model.info.pad_token_id)
            embeddings = self._pooled(torch.from_numpy(ids), torch.from_numpy(mask))[:items]
        except UnplannedShapeError as error:  # a planning bug, not this input's: halving cannot help
            log.error("batch of %d items failed: %s", items, error)
            return [Outcome(chunks, None, error, 0, 0)]
        except Exception as error:
            if is_fatal(error):
                raise
            if items == 1:
                log.warning("batch item failed: %s", error)
                return [Outcome(chunks, None, error, 0, 0)]
            head, tail = _halve(chunks, items // 2)
            return self.compute(head, seq_len) + self.compute(tail, seq_len)
        return [Outcome(chunks, embeddings, None, batch.padded_tokens, batch.real_tokens)]

    @torch.inference_mode()
    def _pooled(self, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        """Host tensors in, pooled float32 rows out (waits for the device)."""
        device = self.model.info.device
        if device.type == "cuda":
            ids = ids.pin_memory().to(device, non_blocking=True)
            mask = mask.pin_memory().to(device, non_blocking=True)
        return self.model.forward(ids, mask).float().cpu().numpy()


def _halve(chunks: list[Chunk], n: int) -> tuple[list[Chunk], list[Chunk]]:
    """The first ``n`` items of a run of chunks, and the rest."""
    head: list[Chunk] = []
    for index, chunk in enumerate(chunks):
        if n >= chunk.items:
            head.append(chunk)
            n -= chunk.items
            continue
        if n == 0:
            return head, chunks[index:]
        first, rest = chunk.split(n)
        return [*head, first], [rest, *chunks[index + 1 :]]
    return head, []
