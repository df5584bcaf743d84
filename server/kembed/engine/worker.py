"""The model's own thread: it loads the model, warms up every batch shape, then computes batches.

One thread owns the model because CUDA graphs captured by ``torch.compile(mode="reduce-overhead")``
live in thread-local state: the thread that warms up is the thread that replays. It never touches
asyncio objects; each finished batch goes back in one ``loop.call_soon_threadsafe`` call.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kembed.config import Batching, Settings, Warmup
from kembed.engine import compile_cache, cpu
from kembed.engine.graphs import CompileCount, ShapeGuard, UnplannedShapeError
from kembed.engine.model import EmbeddingModel
from kembed.engine.work import Batch, Chunk
from kembed.shapes import BatchShapes, batch_tokens, clip_buckets, compiles

log = logging.getLogger(__name__)

# reduce-overhead records CUDA graphs on the first calls of a shape; eager mode's first call of a
# shape pays one-off allocation costs. The last repeat is the one timed.
WARMUP_REPEATS_COMPILED = 3
WARMUP_REPEATS_EAGER = 2
_STANCES = {"fail_on_recompile": "raises (that batch fails)", "none": "is possible (this torch has no stances)"}


@dataclass(frozen=True)
class Plan:
    """What the loaded model is served with: bucket lengths and batch shapes, and the shapes warmed up."""

    bucket_lengths: list[int]
    shapes: BatchShapes
    compiled: bool
    naive: bool
    warmup: Warmup

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """(seq_len, rows) in warmup order: see :func:`warmup_order`."""
        # Compiled, every shape needs its graph before serving: sealing refuses shapes not warmed.
        if self.compiled or self.warmup is Warmup.GRID:
            return warmup_order(self.shapes.grid(self.bucket_lengths))
        return warmup_order([(length, self.shapes.max_rows(length)) for length in self.bucket_lengths])


@dataclass
class Outcome:
    """A run of chunks computed together: their rows, or the error that only they share."""

    chunks: list[Chunk]
    embeddings: np.ndarray | None  # float32 [items, dimensions], in the chunks' order
    error: BaseException | None
    padded_tokens: int
    real_tokens: int


Deliver = Callable[[Batch, list[Outcome], float, float], None]
LoadModel = Callable[[Settings], EmbeddingModel]


def make_plan(settings: Settings, model: EmbeddingModel) -> Plan:
    device = model.info.device
    naive = settings.batching is Batching.NAIVE
    compiled = compiles(settings, device.type)
    max_tokens = model.info.max_input_tokens
    lengths = [max_tokens] if naive else clip_buckets(settings.buckets, max_tokens)
    shapes = BatchShapes.build(settings.max_batch_size, batch_tokens(settings, device.type), fixed=compiled)
    return Plan(lengths, shapes, compiled, naive, settings.warmup)


def warmup_order(shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(seq_len, rows) shapes, largest first, one-row shapes last.

    The first call of the dynamic compile (graphs=capture) sets the size hints inductor tunes its
    kernels for, so it should be the largest batch, not the smallest; dynamo specialises one-row
    batches into a graph of their own, so a one-row shape first would leave the general graph's hints
    to whichever shape came second. Captured first, the largest graph also sizes the shared memory pool
    the smaller ones then reuse.
    """
    return sorted(shapes, key=lambda shape: (shape[1] == 1, -shape[0] * shape[1], -shape[0]))


def warmup_batch(
    rows: int, seq_len: int, vocab_size: int, pad_token_id: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids right-padded as served batches are: the first of several rows fills the length,
    the others (and a lone row) are shorter, so nothing is compiled or captured on "no padding"."""
    lengths = torch.randint(1, max(seq_len, 2), (rows,), generator=generator)
    if rows > 1:
        lengths[0] = seq_len
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).to(torch.int32)
    ids = torch.randint(0, vocab_size, (rows, seq_len), generator=generator, dtype=torch.int32)
    return torch.where(mask.bool(), ids, pad_token_id), mask


def is_fatal(error: BaseException) -> bool:
    """A CUDA error poisons the context: nothing on this device can be trusted afterwards."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and "CUDA error" in str(error)


class Engine:
    """The loaded model and its serving plan: warmup and batch compute, on the worker thread."""

    def __init__(self, model: EmbeddingModel, plan: Plan, graphs: ShapeGuard | None = None) -> None:
        self.model = model
        self.plan = plan
        self.graphs = graphs  # when compiled: which shapes have a graph, sealed after warmup
        self.warmup_tokens = 0  # of the largest batch of each bucket: what seeds the service rate
        self.warmup_seconds = 0.0

    def warm_up(self, beat: Callable[[], None]) -> None:
        """Run every shape (capturing its CUDA graph when compiled); time the largest per bucket."""
        plan, info = self.plan, self.model.info
        repeats = WARMUP_REPEATS_COMPILED if plan.compiled else WARMUP_REPEATS_EAGER
        generator = torch.Generator().manual_seed(0)
        for seq_len, rows in plan.warmup_shapes():
            ids, mask = warmup_batch(rows, seq_len, info.vocab_size, info.pad_token_id, generator)
            for _ in range(repeats):
                started = time.perf_counter()
                self._pooled(ids, mask)
                seconds = time.perf_counter() - started
                beat()
            if rows == plan.shapes.max_rows(seq_len):
                self.warmup_tokens += rows * seq_len
                self.warmup_seconds += seconds
        if self.graphs is not None:  # readiness waits on this: every planned shape has its graph
            stance = self.graphs.seal()
            compiled = CompileCount.total(self.graphs.compiles.values())
            log.info(
                "%d shapes sealed (warmup compiled %s); a recompile while serving %s",
                len(self.graphs.shapes),
                compiled,
                _STANCES[stance],
            )

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


def start_engine(settings: Settings, load_model: LoadModel, beat: Callable[[], None]) -> Engine:
    """Load, compile (through the compile cache when set) and warm up every planned shape."""
    started = time.monotonic()
    model = load_model(settings)
    if model.info.device.type == "cpu":
        cpu.share_cores(settings.cpus(), settings.compute_nice)
    plan = make_plan(settings, model)
    shapes = plan.warmup_shapes()
    graphs = None
    if plan.compiled:
        info = model.info
        ident = compile_cache.identity(info.device, info.path, info.dtype, info.pooling, settings.graphs)
        compile_cache.use(settings.compile_cache_dir, ident, shapes)
        graphs = model.compile(settings.graphs, len(shapes))
    engine = Engine(model, plan, graphs)
    engine.warm_up(beat)
    log.info(
        "warm: %d shapes in %.1f s, %.0f padded tokens/s (%s, %s, compiled=%s, graphs=%s, torch %s)",
        len(shapes),
        time.monotonic() - started,
        engine.warmup_tokens / max(engine.warmup_seconds, 1e-9),
        model.info.device,
        model.info.dtype,
        plan.compiled,
        settings.graphs if plan.compiled else "none",
        torch.__version__,
    )
    return engine


class Worker:
    """The thread around the Engine. It loads and warms up at once: ``warm`` resolves to the Engine,
    or to the error that stopped it. Batches flow once ``serve`` hands it the way back. Once warm, a
    thread that ends other than by ``stop`` tells ``on_fatal`` why, on the loop."""

    def __init__(
        self,
        settings: Settings,
        loop: asyncio.AbstractEventLoop,
        on_fatal: Callable[[BaseException], None],
        load_model: LoadModel = EmbeddingModel.load,
    ) -> None:
        self._settings = settings
        self._loop = loop
        self._on_fatal = on_fatal
        self._load_model = load_model
        self._inbox: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._way_back: queue.SimpleQueue[Deliver | None] = queue.SimpleQueue()  # None: stopped before serving
        self._thread = threading.Thread(target=self._main, name="kembed-worker", daemon=True)
        self.warm: asyncio.Future[Engine] = loop.create_future()
        self.heartbeat = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def serve(self, deliver: Deliver) -> None:
        """Start computing batches; each result goes to ``deliver`` on the event loop."""
        self._way_back.put(deliver)

    def submit(self, batch: Batch) -> None:
        self._inbox.put(batch)

    def stop(self) -> None:
        self._inbox.put(None)
        self._way_back.put(None)

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()

    def _main(self) -> None:
        try:
            engine = start_engine(self._settings, self._load_model, self._beat)
        except BaseException as error:  # reported to the engine process, which exits non-zero
            log.exception("model start-up failed")
            self._loop.call_soon_threadsafe(self._resolve_warm, None, error)
            return
        self._loop.call_soon_threadsafe(self._resolve_warm, engine, None)
        try:
            deliver = self._way_back.get()
            if deliver is not None:
                self._serve(engine, deliver)
        except BaseException as error:  # a device error, or a bug: either way no batch is computed again
            log.critical("worker thread failed, exiting: %r", error, exc_info=True)
            self._loop.call_soon_threadsafe(self._on_fatal, error)

    def _resolve_warm(self, engine: Engine | None, error: BaseException | None) -> None:
        if self.warm.done():
            return
        if engine is not None:
            self.warm.set_result(engine)
        else:
            self.warm.set_exception(error or RuntimeError("start-up failed"))

    def _serve(self, engine: Engine, deliver: Deliver) -> None:
        while True:
            try:
                batch = self._inbox.get(timeout=1.0)  # the timeout only refreshes the heartbeat
            except queue.Empty:
                self._beat()
                continue
            if batch is None:
                return
            self.heartbeat = started = time.monotonic()
            outcomes = engine.compute(batch.live_chunks(), batch.seq_len)  # raises only what is fatal
            seconds = time.monotonic() - started
            self._beat()
            self._loop.call_soon_threadsafe(deliver, batch, outcomes, started, seconds)


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
