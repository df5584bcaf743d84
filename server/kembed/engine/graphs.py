"""CUDA graphs for every planned batch shape, and nothing compiled or eager behind the plan's back.

Two ways to make the graphs (``KEMBED_GRAPHS``; neither has been timed against the other yet):

- ``capture`` (default): one ``torch.compile(dynamic=True)`` of the forward, then a
  ``torch.cuda.CUDAGraph`` captured per planned shape over it. Compile work is paid about once
  (plus a specialization for one-row batches) instead of once per shape, and each capture takes
  milliseconds. Which shapes have a graph is a plain dict, so it can be checked.
- ``static``: ``torch.compile(mode="reduce-overhead", dynamic=False)``, one compile per shape: the
  mechanism measured on an H100 (35 shapes in 174 s with the recompile limit raised).

Either way dynamo's recompile limit is raised to cover the plan and hitting it is an error, because
past the limit dynamo silently runs the shape eager (about 20x slower). After warmup the set of shapes
is sealed: a batch of another shape fails with :class:`UnplannedShapeError`, and a recompile raises
(``set_stance("fail_on_recompile")``) rather than compiling for seconds mid-traffic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kembed.config import Graphs

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
    """The forward, per shape: a shape's first call prepares it (warmup); once sealed, a shape
    that was not prepared is refused instead of compiled or run eager."""

    def __init__(self, prepare: Prepare) -> None:
        self._prepare = prepare
        self._runs: dict[Shape, Forward] = {}
        self.sealed = False

    @property
    def shapes(self) -> frozenset[Shape]:
        return frozenset(self._runs)

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        shape = (int(ids.shape[0]), int(ids.shape[1]))
        run = self._runs.get(shape)
        if run is None:
            if self.sealed:
                raise UnplannedShapeError(
                    f"batch shape {shape[0]}x{shape[1]} is not one of the {len(self._runs)} warmed-up shapes; "
                    "refused rather than compiled or run eager while serving"
                )
            run = self._runs[shape] = self._prepare(ids, attention_mask)
        return run(ids, attention_mask)

    def seal(self) -> str:
        """No new shapes from now on; returns the recompile stance applied."""
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


def capturing(forward: Forward) -> Prepare:
    """Prepare a shape by capturing a CUDA graph of ``forward`` on it; all graphs share one memory
    pool (they run one at a time on one stream, and each output is copied out at once)."""
    pool = torch.cuda.graph_pool_handle()

    def prepare(ids: torch.Tensor, attention_mask: torch.Tensor) -> Forward:
        static_ids, static_mask = ids.clone(), attention_mask.clone()
        side = torch.cuda.Stream(device=ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):
            for _ in range(CALLS_BEFORE_CAPTURE):
                forward(static_ids, static_mask)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward(static_ids, static_mask)
        return _Captured(graph, static_ids, static_mask, output)

    return prepare


def reduce_overhead(forward: Forward) -> Prepare:
    """Prepare every shape with one reduce-overhead compile: cudagraph trees record per shape."""
    graphs = torch.compile(forward, mode="reduce-overhead", dynamic=False)

    def replay(ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # inference: every call starts a new step
        return graphs(ids, attention_mask).clone()  # the next replay overwrites the graph's output

    return lambda ids, attention_mask: replay


def compile_graphs(forward: Forward, mode: Graphs, planned_shapes: int, device: torch.device) -> ShapeGuard:
    """The guarded, graph-replaying forward for ``planned_shapes`` shapes."""
    configure_dynamo(planned_shapes)
    if mode is Graphs.CAPTURE and device.type == "cuda":
        return ShapeGuard(capturing(torch.compile(forward, dynamic=True)))
    if mode is Graphs.CAPTURE:  # CUDA graphs need CUDA; reduce-overhead compiles without them elsewhere
        log.warning("graphs=capture needs CUDA; %s compiles per shape (static) instead", device)
    return ShapeGuard(reduce_overhead(forward))
