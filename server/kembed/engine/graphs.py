"""CUDA graphs for every planned batch shape, and nothing compiled or eager behind the plan's back.

Two ways to make the graphs (``KEMBED_GRAPHS``; neither has been timed against the other yet):

- ``capture`` (default): one ``torch.compile(dynamic=True)`` of the forward, then a
  ``torch.cuda.CUDAGraph`` captured per planned shape over it. Compile work is paid about once
  (plus a specialization for one-row batches) instead of once per shape, and each capture takes
  milliseconds. Which shapes have a graph is a plain dict, so it can be checked.
- ``static``: ``torch.compile(mode="reduce-overhead", dynamic=False)``, one compile per shape: the
  mechanism measured on an H100 (35 shapes in 174 s with the recompile limit raised).

Either way the forward compiles as one whole graph (``fullgraph=True``): a graph break would leave
eager Python between graphs, which in capture mode runs inside ``torch.cuda.graph`` (a host sync
there fails the capture; a data-dependent branch is frozen at its warmup value). Dynamo's recompile
limit is raised to cover the plan and hitting it is an error, because past the limit dynamo silently
runs the shape eager (about 20x slower). What each shape compiled is counted (:class:`CompileCount`),
and a warmup that compiled nothing fails instead of serving eager code as compiled. After warmup the
set of shapes is sealed: a batch of another shape fails with :class:`UnplannedShapeError`, and a
recompile raises (``set_stance("fail_on_recompile")``) rather than compiling for seconds mid-traffic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kembed.config.values import Graphs

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Prepare = Callable[[torch.Tensor, torch.Tensor], Forward]
Shape = tuple[int, int]  # (rows, seq_len), as the tensors are laid out

# Headroom over one cache entry per planned shape: dynamo's own default limit, for guard failures
# that are not shapes (the first dynamic-shape recompile, a one-row specialization).
LIMIT_HEADROOM = 8
# Graph breaks add resume functions, each with its own entries; the accumulated limit counts them all.
ACCUMULATED_PER_LIMIT = 16
# Eager calls of a new shape before its capture: the compile, autotuning and lazy allocations
# (cuBLAS workspaces) happen there, outside the capture, as torch.cuda.graph's docs ask.
CALLS_BEFORE_CAPTURE = 2


class UnplannedShapeError(RuntimeError):
    """A batch of a shape warmup did not prepare: serving it would compile or run eager mid-traffic."""


class NothingCompiledError(RuntimeError):
    """A compiled plan's warmup compiled no graph: the forward ran eager (dynamo disabled or skipped)."""


@dataclass(frozen=True)
class CompileCount:
    """What dynamo and inductor compiled in this process: totals, or the difference of two readings.

    Replays of a captured CUDA graph run no Python and move none of these, and neither does an
    eager forward: only compiling does, so they tell a compiled warmup from an eager one.
    """

    graphs: int = 0  # FX graphs dynamo handed to the backend (a recompile adds one)
    kernels: int = 0  # kernels inductor generated, or loaded from its cache on a warm start
    graph_breaks: int = 0

    @classmethod
    def now(cls) -> CompileCount:
        from torch._dynamo.utils import counters
        from torch._inductor import metrics

        return cls(
            graphs=counters["stats"]["unique_graphs"],
            kernels=metrics.generated_kernel_count,
            graph_breaks=sum(counters["graph_break"].values()),
        )

    def __add__(self, other: CompileCount) -> CompileCount:
        return CompileCount(
            self.graphs + other.graphs, self.kernels + other.kernels, self.graph_breaks + other.graph_breaks
        )

    def __sub__(self, other: CompileCount) -> CompileCount:
        return self + CompileCount(-other.graphs, -other.kernels, -other.graph_breaks)

    @staticmethod
    def total(counts: Iterable[CompileCount]) -> CompileCount:
        return sum(counts, CompileCount())


def recompile_limit(planned_shapes: int) -> int:
    """Cache entries per compiled function that the plan can need."""
    return planned_shapes + LIMIT_HEADROOM


def _first_config(names: tuple[str, ...]) -> str | None:
    config = torch._dynamo.config
    return next((name for name in names if hasattr(config, name)), None)


def configure_dynamo(planned_shapes: int) -> dict[str, int | bool]:
    """Raise dynamo's recompile limits to cover the plan and make hitting one an error.

    Call it from the compiling thread: torch 2.13 keeps config overrides in a context variable, which
    a new thread does not inherit. Names differ across torch versions (``cache_size_limit`` became
    ``recompile_limit``); the settings applied are logged and returned, and a limit is never lowered.
    """
    limit = recompile_limit(planned_shapes)
    wanted: list[tuple[tuple[str, ...], int | bool]] = [
        (("recompile_limit", "cache_size_limit"), limit),
        (("accumulated_recompile_limit", "accumulated_cache_size_limit"), limit * ACCUMULATED_PER_LIMIT),
        (("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True),
    ]
    applied: dict[str, int | bool] = {}
    for names, value in wanted:
        name = _first_config(names)
        if name is None:
            log.warning("torch %s has no torch._dynamo.config.%s; left as it is", torch.__version__, names[0])
            continue
        current = getattr(torch._dynamo.config, name)
        applied[name] = value if isinstance(value, bool) else max(int(current), value)
        setattr(torch._dynamo.config, name, applied[name])
    log.info("dynamo (torch %s) for %d planned shapes: %s", torch.__version__, planned_shapes, applied)
    return applied


def forbid_recompiles() -> str:
    """After warmup a recompile raises; returns the stance used ("none" where torch has no stances)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        log.warning("torch %s has no torch.compiler.set_stance: recompiles stay possible", torch.__version__)
        return "none"
    set_stance("fail_on_recompile")
    return "fail_on_recompile"


class ShapeGuard:
    """The forward, per shape: a shape's first call prepares it (warmup) and counts what that
    compiled; once sealed, a shape that was not prepared is refused instead of compiled or run eager.

    ``compiled``: the plan compiles, so sealing a warmup that compiled nothing is an error.
    """

    def __init__(self, prepare: Prepare, compiled: bool = False) -> None:
        self._prepare = prepare
        self._runs: dict[Shape, Forward] = {}
        self._compiled = compiled
        self.compiles: dict[Shape, CompileCount] = {}  # what each shape's preparation compiled
        self.sealed = False

    @property
    def shapes(self) -> frozenset[Shape]:
        return frozenset(self._runs)

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        shape = (int(ids.shape[0]), int(ids.shape[1]))
        run = self._runs.get(shape)
        if run is not None:
            return run(ids, attention_mask)
        if self.sealed:
            raise UnplannedShapeError(
                f"batch shape {shape[0]}x{shape[1]} is not one of the {len(self._runs)} warmed-up shapes; "
                "refused rather than compiled or run eager while serving"
            )
        before = CompileCount.now()
        run = self._prepare(ids, attention_mask)
        output = run(ids, attention_mask)  # static mode compiles on this first call
        self.compiles[shape] = CompileCount.now() - before
        self._runs[shape] = run
        return output

    def seal(self) -> str:
        """No new shapes from now on; returns the recompile stance applied."""
        compiled = CompileCount.total(self.compiles.values())
        if self._compiled and self._runs and compiled.graphs == 0:
            raise NothingCompiledError(
                f"warmup of {len(self._runs)} shapes compiled no graph ({compiled}): the forward ran eager "
                "(is dynamo disabled, or torch.compiler's stance force_eager?); refusing to serve it as compiled"
            )
        self.sealed = True
        return forbid_recompiles()


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # the graph's static inputs and output
    attention_mask: torch.Tensor
    output: torch.Tensor

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids, non_blocking=True)
        self.attention_mask.copy_(attention_mask, non_blocking=True)
        self.graph.replay()
        return self.output.clone()  # the next replay overwrites the output


def capturing(forward: Forward, device: torch.device) -> Prepare:
    """Prepare a shape by capturing a CUDA graph of ``forward`` on it; all graphs share one memory
    pool (they run one at a time on one stream, and each output is copied out at once) and one side
    stream on ``device`` for the calls before capture and the capture itself (torch.cuda.graph's
    default capture stream belongs to whichever device was current when it was first made)."""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(device=device)

    def prepare(ids: torch.Tensor, attention_mask: torch.Tensor) -> Forward:
        static_ids, static_mask = ids.clone(), attention_mask.clone()
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(CALLS_BEFORE_CAPTURE):
                forward(static_ids, static_mask)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side):
            output = forward(static_ids, static_mask)
        return _Captured(graph, static_ids, static_mask, output)

    return prepare


def compile_forward(forward: Forward, mode: Graphs) -> Forward:
    """``forward`` compiled for ``mode``, as one whole graph or an error at its first call."""
    if mode is Graphs.CAPTURE:
        return torch.compile(forward, dynamic=True, fullgraph=True)
    return torch.compile(forward, mode="reduce-overhead", dynamic=False, fullgraph=True)


def reduce_overhead(graphs: Forward) -> Prepare:
    """Prepare every shape with one reduce-overhead compile: cudagraph trees record per shape."""

    def replay(ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # inference: every call starts a new step
        return graphs(ids, attention_mask).clone()  # the next replay overwrites the graph's output

    return lambda ids, attention_mask: replay


def compile_graphs(forward: Forward, mode: Graphs, planned_shapes: int, device: torch.device) -> ShapeGuard:
    """The guarded, graph-replaying forward for ``planned_shapes`` shapes; call it from the thread
    that will replay them, which it makes current on ``device`` (captures, Triton's launches and
    torch.cuda.graph's synchronisation use the current device, cuda:0 unless set)."""
    configure_dynamo(planned_shapes)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if mode is Graphs.CAPTURE and device.type == "cuda":
        return ShapeGuard(capturing(compile_forward(forward, mode), device), compiled=True)
    if mode is Graphs.CAPTURE:  # CUDA graphs need CUDA; reduce-overhead compiles without them elsewhere
        log.warning("graphs=capture needs CUDA; %s compiles per shape (static) instead", device)
    return ShapeGuard(reduce_overhead(compile_forward(forward, Graphs.STATIC)), compiled=True)
