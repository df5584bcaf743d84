"""The model's own thread: it loads the model, chooses its dtype, warms up every batch shape, then
computes batches.

One thread owns the model because CUDA graphs captured by ``torch.compile(mode="reduce-overhead")``
live in thread-local state: the thread that warms up is the thread that replays. It never touches
asyncio objects; each finished batch goes back in one ``loop.call_soon_threadsafe`` call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kembed.config import Dtype, Settings, Warmup
from kembed.engine import compile_cache, cpu, cpu_compile, precision
from kembed.engine.buckets import route
from kembed.engine.cpu_compile import Served
from kembed.engine.graphs import CompileCount, ShapeGuard, UnplannedShapeError
from kembed.engine.model import EmbeddingModel, ModelInfo
from kembed.engine.precision import PROBE_TEXTS, Precision
from kembed.engine.units import Batch, Chunk
from kembed.inputs import Sequences
from kembed.shapes import BatchShapes, Queueing, batch_tokens

log = logging.getLogger(__name__)

# reduce-overhead records CUDA graphs on the first calls of a shape; eager mode's first call of a
# shape pays one-off allocation costs. The fastest repeat is the one timed.
WARMUP_REPEATS_COMPILED = 3
WARMUP_REPEATS_EAGER = 2
OVERHEAD_REPEATS = 3  # a small batch's time is the most easily inflated by load elsewhere
# Compiled against eager on a CPU: the compiled forward's first call compiles, the fastest of the
# rest is timed, interleaved with eager's.
COMPARE_REPEATS = 5
_STANCES = {"fail_on_recompile": "raises (that batch fails)", "none": "is possible (this torch has no stances)"}


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


@dataclass
class Outcome:
    """A run of chunks computed together: their rows, or the error that only they share."""

    chunks: list[Chunk]
    embeddings: np.ndarray | None  # float32 [items, dimensions], in the chunks' order
    error: BaseException | None
    padded_tokens: int
    real_tokens: int


@dataclass(frozen=True)
class Computed:
    """When and where a batch was computed: its lane, start and compute seconds."""

    lane: int
    started: float
    seconds: float


Deliver = Callable[[Batch, list[Outcome], Computed], None]
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

    @property
    def precision(self) -> Precision:
        return Precision(str(self.model.info.dtype).removeprefix("torch."), self.why)

    def warm_up(self, beat: Callable[[], None], done: Sequence[tuple[int, int]] = ()) -> None:
        """Run every shape not ``done`` yet (capturing its CUDA graph when compiled); time the
        largest per bucket, and when packed a batch's overhead."""
        warm_up_together([self], beat, [shape for shape in self.plan.warmup_shapes() if shape not in done])
        if self.plan.packed:
            measure_overhead(self, beat)
        if self.graphs is not None:  # readiness waits on this: every planned shape has its graph
            stance = self.graphs.seal()
            compiled = CompileCount.total(self.graphs.compiles.values())
            log.info(
                "%d shapes sealed (warmup compiled %s); a recompile while serving %s",
                len(self.graphs.shapes),
                compiled,
                _STANCES[stance],
            )

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


def warm_up_together(
    runners: Sequence[ModelRunner], beat: Callable[[], None], shapes: Sequence[tuple[int, int]], repeats: int = 0
) -> list[list[float]]:
    """Run planned shapes on each runner, on the same batches and alternating call by call (so their
    timings compare, and a burst of load elsewhere slows each alike); time the largest batch per
    bucket. Returns each runner's seconds (its fastest call) on each shape."""
    plan, info = runners[0].plan, runners[0].model.info
    repeats = repeats or (WARMUP_REPEATS_COMPILED if plan.compiled else WARMUP_REPEATS_EAGER)
    generator = torch.Generator().manual_seed(0)
    spent: list[list[float]] = [[] for _ in runners]
    for seq_len, rows in shapes:
        ids, mask = warmup_batch(rows, seq_len, info.vocab_size, info.pad_token_id, generator)
        fastest = [math.inf] * len(runners)
        for _ in range(repeats):
            for index, runner in enumerate(runners):
                fastest[index] = min(fastest[index], runner.timed(ids, mask, 1, beat))
        for index, (runner, seconds) in enumerate(zip(runners, fastest, strict=True)):
            spent[index].append(seconds)
            if rows == plan.shapes.max_rows(seq_len):
                runner.warmup_tokens += rows * seq_len
                runner.warmup_seconds += seconds
    return spent


def measure_overhead(runner: ModelRunner, beat: Callable[[], None]) -> None:
    """Packed: time a small batch (an eighth of the shortest bucket's largest) against the warm
    rate: what a batch costs beyond its tokens, where packing weighs it."""
    plan, info = runner.plan, runner.model.info
    shortest = plan.bucket_lengths[0]
    rows = max(1, plan.shapes.max_rows(shortest) // 8)
    ids, mask = warmup_batch(rows, shortest, info.vocab_size, info.pad_token_id, torch.Generator().manual_seed(1))
    per_token = runner.warmup_seconds / max(runner.warmup_tokens, 1)
    small = runner.timed(ids, mask, OVERHEAD_REPEATS, beat)
    runner.overhead_tokens = batch_overhead(small, rows * shortest, per_token, plan.shapes.max_tokens)


# A batch's overhead is taken within these shares of the token budget. The batch curve
# (bench.ceiling) fitted 30 (fp32) and 74 (bf16) tokens on a 2-core EPYC, against the 2048-token
# default; a timing outside is one that load elsewhere skewed. Packing is not sensitive within
# them (bench.packing: within 0.02 of its best from 40 to 128 tokens), but at 0 it would compute
# every item alone, and far above it pads batches past what they are worth.
OVERHEAD_SHARES = (1 / 64, 1 / 16)


def batch_overhead(seconds: float, tokens: int, per_token: float, max_tokens: int) -> float:
    """What a batch costs beyond its tokens, in tokens: a small batch's time less its tokens' share
    at a full batch's rate, within ``OVERHEAD_SHARES`` of the budget."""
    least, most = (max_tokens * share for share in OVERHEAD_SHARES)
    measured = seconds / per_token - tokens if per_token > 0 else least
    return min(max(least, measured), most)


def probe_vectors(runner: ModelRunner) -> np.ndarray:
    """The runner's vectors of the probe texts (real text, not random ids)."""
    return runner.embed(runner.model.tokenizer.from_texts(list(PROBE_TEXTS), truncate=True))


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The least cosine between matching rows (0 where either is a zero vector)."""
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cosines = np.where(norms > 0, np.sum(a * b, axis=1) / np.where(norms > 0, norms, 1.0), 0.0)
    return float(cosines.min())


def _graphs(settings: Settings, model: EmbeddingModel, plan: Plan) -> ShapeGuard | None:
    """Compiled: graphs prepared through the compile cache (when set) as warmup runs each shape."""
    if not plan.compiled:
        return None
    info, shapes = model.info, plan.warmup_shapes()
    ident = compile_cache.identity(info.device, info.path, info.dtype, info.pooling, settings.graphs)
    compile_cache.use(settings.compile_cache_dir, ident, shapes)
    return model.compile(settings.graphs, len(shapes))


def measured_runner(
    settings: Settings, fp32: EmbeddingModel, plan: Plan, load_model: LoadModel, beat: Callable[[], None]
) -> ModelRunner | None:
    """Auto on a CPU with bf16 units (eager): time fp32 and bf16 side by side on the same batches,
    check bf16's vectors against fp32's on real text, and keep the runner :func:`precision.measured`
    picks, warmed on every shape. None where the dtype needs no measuring."""
    device = fp32.info.device.type
    if plan.compiled or not precision.measures(settings.dtype, device, bf16_units(device)):
        return None
    candidate = load_model(settings.model_copy(update={"dtype": Dtype.BFLOAT16}))
    if candidate.info.dtype != torch.bfloat16:  # a loader that ignores the dtype asked for
        return _warm(ModelRunner(fp32, plan, why=f"auto: bf16 asked, the loader gave {candidate.info.dtype}"), beat)
    runners = [ModelRunner(fp32, plan), ModelRunner(candidate, plan)]
    compared = comparison_shapes(plan)
    fp32_seconds, bf16_seconds = map(sum, warm_up_together(runners, beat, compared))
    cosine = min_cosine(*map(probe_vectors, runners))
    choice = precision.measured(fp32_seconds, bf16_seconds, cosine)
    kept = runners[1] if choice.dtype == Dtype.BFLOAT16.value else runners[0]
    kept.why = choice.why
    kept.warm_up(beat, done=compared)
    return kept


def comparison_shapes(plan: Plan) -> list[tuple[int, int]]:
    """What auto times both dtypes on: the largest batch of the longest bucket and of the shortest,
    where attention and the dense layers weigh most. Timing fp32 on every shape took most of the
    start-up (docs/decisions/bf16-on-cpu.md); the dtype kept warms the rest."""
    ends = dict.fromkeys((plan.bucket_lengths[-1], plan.bucket_lengths[0]))
    return [(length, plan.shapes.max_rows(length)) for length in ends]


def bf16_units(device_type: str) -> tuple[str, ...]:
    """The bf16 units of the device the model runs on, if it is a CPU (a GPU is not asked)."""
    return precision.bf16_units() if device_type == "cpu" else ()


def _warm(runner: ModelRunner, beat: Callable[[], None]) -> ModelRunner:
    runner.warm_up(beat)
    return runner


def served_runner(settings: Settings, eager: ModelRunner, beat: Callable[[], None]) -> ModelRunner:
    """The forward that serves (see :mod:`kembed.engine.cpu_compile`): on a CPU unless off, the warm
    eager runner's forward compiled, timed against eager on the shapes the dtype choice compares
    (at a lane's threads, as served) and checked on real text; the runner
    :func:`cpu_compile.measured` picks, warmed on every shape. Eager where the compile fails."""
    plan, info = eager.plan, eager.model.info
    if not Queueing.of(settings).compiles_forward(info.device.type):
        eager.served = cpu_compile.unmeasured(settings.compile, plan.compiled)
        return eager
    threads = cpu.lane_threads(settings.cpus(), plan.lanes)
    compared = comparison_shapes(plan)
    compile_cache.use(settings.compile_cache_dir, cpu_cache_identity(info, threads), compared)
    candidate = ModelRunner(eager.model.compiled_on_cpu(threads), plan, why=eager.why)
    started = time.monotonic()
    try:
        # All of it at a lane's threads, as served: dynamo guards on the thread count, so a call at
        # another count would compile a graph no lane runs.
        with cpu.threads_of_a_lane(threads):
            eager_s, compiled_s = warm_up_together([eager, candidate], beat, compared, COMPARE_REPEATS)
            cosine = min_cosine(*map(probe_vectors, (eager, candidate)))
            choice = cpu_compile.measured(settings.compile, compared, eager_s, compiled_s, cosine)
            if choice.forward == cpu_compile.COMPILED:
                candidate.warm_up(beat, done=compared)
                candidate.timed(*one_row_batch(plan, info), 1, beat)  # dynamo specialises one-row batches
    except Exception as error:  # no compiler, an unwritable cache, a bug in inductor: eager still serves
        eager.served = cpu_compile.failed(error)
        log.error("%s", eager.served.why, exc_info=True)
        return eager
    log.info(
        "forward: %s (%s), compiled and compared in %.1f s", choice.forward, choice.why, time.monotonic() - started
    )
    kept = candidate if choice.forward == cpu_compile.COMPILED else eager
    kept.served = choice
    return kept


def cpu_cache_identity(info: ModelInfo, threads: int) -> compile_cache.Identity:
    """The compile cache's identity of a CPU compile with kernels for ``threads`` threads."""
    return compile_cache.identity(info.device, info.path, info.dtype, info.pooling, f"cpu-{threads}-threads")


def one_row_batch(plan: Plan, info: ModelInfo) -> tuple[torch.Tensor, torch.Tensor]:
    return warmup_batch(1, plan.bucket_lengths[0], info.vocab_size, info.pad_token_id, torch.Generator())


def start_runner(settings: Settings, load_model: LoadModel, beat: Callable[[], None]) -> ModelRunner:
    """Load, choose the dtype (see :mod:`kembed.engine.precision`), compile (through the compile
    cache when set) and warm up every planned shape."""
    started = time.monotonic()
    model = load_model(settings)
    device = model.info.device
    if device.type == "cpu":
        cpu.share_cores(settings.cpus(), settings.compute_nice)
    plan = make_plan(settings, model)
    runner = measured_runner(settings, model, plan, load_model, beat)
    if runner is None:
        why = precision.unmeasured(settings.dtype, device.type, bf16_units(device.type)).why
        runner = _warm(ModelRunner(model, plan, _graphs(settings, model, plan), why), beat)
    runner = served_runner(settings, runner, beat)
    log.info(
        "warm: %d shapes in %.1f s, %.0f padded tokens/s, batch overhead %.0f tokens (%s, %s: %s; %s: %s; "
        "graphs=%s, torch %s)",
        len(plan.warmup_shapes()),
        time.monotonic() - started,
        runner.warmup_tokens / max(runner.warmup_seconds, 1e-9),
        runner.overhead_tokens,
        device,
        runner.precision.dtype,
        runner.why,
        runner.served.forward,
        runner.served.why,
        settings.graphs if plan.compiled else "none",
        torch.__version__,
    )
    return runner


class Worker:
    """The threads around the ModelRunner. The first loads and warms up at once: ``warm`` resolves to
    the ModelRunner, or to the error that stopped it. Batches flow once ``serve`` hands it the way back,
    to as many lanes as the plan computes at once (the first thread and its siblings), each taking the
    next batch when free. Once warm, a lane that ends other than by ``stop`` tells ``on_fatal`` why, on
    the loop."""

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
        self._lanes = 1
        self.warm: asyncio.Future[ModelRunner] = loop.create_future()
        self.heartbeat = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def serve(self, deliver: Deliver) -> None:
        """Start computing batches; each result goes to ``deliver`` on the event loop."""
        self._way_back.put(deliver)

    def submit(self, batch: Batch) -> None:
        self._inbox.put(batch)

    def stop(self) -> None:
        for _ in range(self._lanes):
            self._inbox.put(None)
        self._way_back.put(None)

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()

    def _main(self) -> None:
        try:
            engine = start_runner(self._settings, self._load_model, self._beat)
        except BaseException as error:  # reported to the engine process, which exits non-zero
            log.exception("model start-up failed")
            self._loop.call_soon_threadsafe(self._resolve_warm, None, error)
            return
        self._lanes = engine.plan.lanes  # before warm resolves: stop() puts one None per lane
        self._loop.call_soon_threadsafe(self._resolve_warm, engine, None)
        deliver = self._way_back.get()
        if deliver is None:
            return
        threads = cpu.lane_threads(self._settings.cpus(), self._lanes)
        if self._lanes > 1:
            log.info("computing %d batches at once, each on %d compute thread(s)", self._lanes, threads)
        for lane in range(1, self._lanes):  # created here, they inherit the compute threads' niceness
            name = f"kembed-worker-{lane}"
            threading.Thread(target=self._lane, args=(engine, deliver, lane, threads), name=name, daemon=True).start()
        self._lane(engine, deliver, 0, threads)

    def _resolve_warm(self, engine: ModelRunner | None, error: BaseException | None) -> None:
        if self.warm.done():
            return
        if engine is not None:
            self.warm.set_result(engine)
        else:
            self.warm.set_exception(error or RuntimeError("start-up failed"))

    def _lane(self, engine: ModelRunner, deliver: Deliver, lane: int, threads: int) -> None:
        try:
            if self._lanes > 1:
                cpu.enter_lane(threads)
            self._serve(engine, deliver, lane)
        except BaseException as error:  # a device error, or a bug: either way no batch is computed again
            log.critical("worker thread failed, exiting: %r", error, exc_info=True)
            self._loop.call_soon_threadsafe(self._on_fatal, error)

    def _serve(self, engine: ModelRunner, deliver: Deliver, lane: int) -> None:
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
            computed = Computed(lane, started, time.monotonic() - started)
            self._beat()
            self._loop.call_soon_threadsafe(deliver, batch, outcomes, computed)


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
