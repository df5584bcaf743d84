"""Start-up on the worker thread: load the model, choose its dtype (:mod:`kembed.engine.precision`)
and its forward (:mod:`kembed.engine.cpu_compile`), and warm up every planned shape, timing what
seeds the service rate. :func:`start_runner` returns the warm :class:`~kembed.engine.runner.ModelRunner`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kembed.config.settings import Settings
from kembed.config.values import Dtype, Toggle
from kembed.engine import compile_cache, cpu, cpu_compile, precision, verdicts
from kembed.engine.cpu_compile import Served
from kembed.engine.graphs import CompileCount, ShapeGuard
from kembed.engine.model import EmbeddingModel, ModelInfo
from kembed.engine.precision import PROBE_TEXTS
from kembed.engine.runner import LoadModel, ModelRunner, Plan, make_plan
from kembed.policy.shapes import Queueing

log = logging.getLogger(__name__)


def warm_up(runner: ModelRunner, beat: Callable[[], None], done: Sequence[tuple[int, int]] = ()) -> None:
    """Run every shape not ``done`` yet (capturing its CUDA graph when compiled); time the
    largest per bucket, and when packed a batch's overhead."""
    warm_up_together([runner], beat, [shape for shape in runner.plan.warmup_shapes() if shape not in done])
    if runner.plan.packed:
        measure_overhead(runner, beat)
    if runner.graphs is not None:  # readiness waits on this: every planned shape has its graph
        stance = runner.graphs.seal()
        compiled = CompileCount.total(runner.graphs.compiles.values())
        log.info(
            "%d shapes sealed (warmup compiled %s); a recompile while serving %s",
            len(runner.graphs.shapes),
            compiled,
            _STANCES[stance],
        )


# reduce-overhead records CUDA graphs on the first calls of a shape; eager mode's first call of a
# shape pays one-off allocation costs. The fastest repeat is the one timed.
WARMUP_REPEATS_COMPILED = 3


WARMUP_REPEATS_EAGER = 2


OVERHEAD_REPEATS = 3  # a small batch's time is the most easily inflated by load elsewhere


# Compiled against eager on a CPU: the compiled forward's first call compiles, the fastest of the
# rest is timed, interleaved with eager's.
COMPARE_REPEATS = 5


_STANCES = {"fail_on_recompile": "raises (that batch fails)", "none": "is possible (this torch has no stances)"}


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
    ident = verdicts.identity("dtype", fp32.info.path, cpus=str(settings.cpus()))
    with verdicts.held(settings.compile_cache_dir, ident) as kept:
        if kept.found is not None:
            return _dtype_as_kept(settings, fp32, plan, load_model, beat, kept)
        candidate = load_model(settings.model_copy(update={"dtype": Dtype.BFLOAT16}))
        if candidate.info.dtype != torch.bfloat16:  # a loader that ignores the dtype asked for
            why = f"auto: bf16 asked, the loader gave {candidate.info.dtype}"
            return _warm(ModelRunner(fp32, plan, why=why), beat)
        runners = [ModelRunner(fp32, plan), ModelRunner(candidate, plan)]
        compared = comparison_shapes(plan)
        fp32_seconds, bf16_seconds = map(sum, warm_up_together(runners, beat, compared))
        cosine = min_cosine(*map(probe_vectors, runners))
        choice = precision.measured(fp32_seconds, bf16_seconds, cosine)
        kept.keep({"dtype": choice.dtype, "why": choice.why})
    chosen = runners[1] if choice.dtype == Dtype.BFLOAT16.value else runners[0]
    chosen.why = choice.why
    warm_up(chosen, beat, done=compared)
    return chosen


def _dtype_as_kept(
    settings: Settings,
    fp32: EmbeddingModel,
    plan: Plan,
    load_model: LoadModel,
    beat: Callable[[], None],
    kept: verdicts.Kept,
) -> ModelRunner:
    """The dtype an earlier start measured and kept, warmed on every shape: nothing timed."""
    found = kept.found or {}
    bf16 = found.get("dtype") == Dtype.BFLOAT16.value
    model = load_model(settings.model_copy(update={"dtype": Dtype.BFLOAT16})) if bf16 else fp32
    return _warm(ModelRunner(model, plan, why=kept.read_why(found.get("why", ""))), beat)


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
    warm_up(runner, beat)
    return runner


def compiles_while_serving(settings: Settings, runner: ModelRunner) -> bool:
    """Whether a forward is compiled for this runner once it serves (a CPU, unless off)."""
    return Queueing.of(settings).compiles_forward(runner.model.info.device.type)


def compile_while_serving(settings: Settings, runner: ModelRunner) -> Served:
    """On the worker's compile thread, while ``runner`` serves eager (see :mod:`kembed.engine.cpu_compile`):
    its forward compiled, timed against eager on the shapes the dtype choice compares (at a lane's
    threads, as served, alternating call by call with the lanes' own load on both) and checked on real
    text; where :func:`cpu_compile.measured` picks it, warmed on every shape and handed to the runner,
    whose lanes take it at their next batch. Eager stays where the compile fails. Under ``auto``, a
    verdict an earlier start kept (:mod:`kembed.engine.verdicts`) is followed instead of measured."""
    plan, info = runner.plan, runner.model.info
    threads = cpu.lane_threads(settings.cpus(), plan.lanes)
    root = settings.compile_cache_dir if settings.compile is Toggle.AUTO else ""  # an explicit setting wins
    ident = verdicts.identity("forward", info.path, dtype=str(info.dtype), lane_threads=str(threads))
    started = time.monotonic()
    with verdicts.held(root, ident) as kept:
        try:
            choice, model = _forward_chosen(settings, runner, threads, kept)
        except Exception as error:  # no compiler, an unwritable cache, a bug in inductor: eager still serves
            failed = cpu_compile.failed(error)
            log.error("%s", failed.why, exc_info=True)
            runner.served = failed
            return failed
        if kept.found is None:
            kept.keep({"forward": choice.forward, "why": choice.why})
    log.info("forward: %s (%s), chosen in %.1f s", choice.forward, choice.why, time.monotonic() - started)
    runner.adopt(model, choice)
    return choice


def _forward_chosen(
    settings: Settings, runner: ModelRunner, threads: int, kept: verdicts.Kept
) -> tuple[Served, EmbeddingModel]:
    """The forward to serve and its model: measured, or as ``kept`` found it (a kept eager compiles
    nothing; a kept compiled is compiled and checked on real text, not timed)."""
    plan, info = runner.plan, runner.model.info
    if kept.found is not None and kept.found.get("forward") != cpu_compile.COMPILED:
        return Served(cpu_compile.EAGER, kept.read_why(kept.found.get("why", ""))), runner.model
    compared = comparison_shapes(plan)
    compile_cache.use(settings.compile_cache_dir, cpu_cache_identity(info, threads), compared)
    # The serving runner's own timings seeded the service rate: these runners are the measure's.
    eager = ModelRunner(runner.model, plan, why=runner.why)
    candidate = ModelRunner(runner.model.compiled_on_cpu(threads), plan, why=runner.why)
    # All of it at a lane's threads, as served: dynamo guards on the thread count, so a call at
    # another count would compile a graph no lane runs.
    with cpu.threads_of_a_lane(threads):
        if kept.found is None:
            eager_s, compiled_s = warm_up_together([eager, candidate], _unwatched, compared, COMPARE_REPEATS)
        cosine = min_cosine(*map(probe_vectors, (eager, candidate)))
        if kept.found is None:
            choice = cpu_compile.measured(settings.compile, compared, eager_s, compiled_s, cosine)
        else:
            choice = cpu_compile.as_kept(kept.read_why(kept.found.get("why", "")), cosine)
        if choice.forward != cpu_compile.COMPILED:
            return choice, runner.model
        warm_up(candidate, _unwatched, done=compared if kept.found is None else ())
        candidate.timed(*one_row_batch(plan, info), 1, _unwatched)  # dynamo specialises one-row batches
    return choice, candidate.model


def _unwatched() -> None:
    """The compile thread's beat: none. The worker's heartbeat says whether its lanes live."""


def cpu_cache_identity(info: ModelInfo, threads: int) -> compile_cache.Identity:
    """The compile cache's identity of a CPU compile with kernels for ``threads`` threads."""
    return compile_cache.identity(info.device, info.path, info.dtype, info.pooling, f"cpu-{threads}-threads")


def one_row_batch(plan: Plan, info: ModelInfo) -> tuple[torch.Tensor, torch.Tensor]:
    return warmup_batch(1, plan.bucket_lengths[0], info.vocab_size, info.pad_token_id, torch.Generator())


def start_runner(settings: Settings, load_model: LoadModel, beat: Callable[[], None]) -> ModelRunner:
    """Load, choose the dtype (see :mod:`kembed.engine.precision`), compile graphs (through the
    compile cache when set) and warm up every planned shape. A CPU's compiled forward comes later,
    while eager serves: :func:`compile_while_serving`."""
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
    compiling = compiles_while_serving(settings, runner)
    runner.served = (
        cpu_compile.pending(settings.compile) if compiling else cpu_compile.unmeasured(settings.compile, plan.compiled)
    )
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
