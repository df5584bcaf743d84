"""Which forward serves on a CPU (``KEMBED_COMPILE``), and why: eager, or compiled by inductor.

On a CPU the eager plan (batches packed by length, computed in lanes) keeps its shapes; what
changes is the forward: ``torch.compile(dynamic=True)``, so one compile covers every packed shape.
Inductor's ``freezing`` (weights folded in as constants) is off: it computed no faster here, and it
tripled the cold compile and bypasses AOT autograd's cache, so a warm start took 16 s instead of 2 s
(docs/decisions/cpu-compile.md). Inductor on a CPU writes C++ and
builds it with ``g++`` (``CXX``) into its cache (``KEMBED_COMPILE_CACHE_DIR`` when set), and its
kernels fix their OpenMP thread count when generated: they are compiled for a lane's threads
(``cpp.threads``), so lanes computing at once never run more threads than the CPUs.

An explicit setting wins: ``off`` serves eager, ``on`` compiled. ``auto`` compiles, times compiled
against eager on the same warmup batches (at a lane's threads, as served) and compares their
vectors on :data:`~kembed.engine.precision.PROBE_TEXTS`; it serves compiled where it is at least
``MIN_SPEEDUP`` faster overall, no compared shape is under ``MIN_SHAPE_SPEEDUP``, and the cosine is
at least ``MIN_COSINE``; else eager. The verdict is kept for later starts
(:mod:`kembed.engine.verdicts`). A compile that fails (no compiler, a cache it cannot write) serves eager. The reason is
logged and published (Info, ``/health``, ``kembed_serving_forward``), as the dtype's is.

Batching ``naive`` (the baseline) and fixed-shape graphs (CUDA, or ``KEMBED_GRAPHS=static``) are
not this module's: see :mod:`kembed.engine.graphs`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kembed.config.values import Toggle
from kembed.contract import COMPILING, env_name
from kembed.engine.precision import MIN_COSINE

EAGER = "eager"
COMPILED = "compiled"  # inductor, dynamic shapes, on a CPU
GRAPHS = "graphs"  # fixed-shape graphs (kembed.engine.graphs)
# Compiled vectors differ from eager's by rounding only (cosine ~0.99995): it must be clearly faster
# to be worth its compile, not faster within the noise of a warmup on shared cores.
MIN_SPEEDUP = 1.05
# No compared shape may be clearly slower; one at 1.00x beside a 1.12x overall is noise, not a loss.
MIN_SHAPE_SPEEDUP = 0.95

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The compile beside serving starts once the pod's CPUs have been this idle over SPARE_WINDOW_S,
# or after SPARE_MAX_WAIT_S whatever the load: a pod that joins under load serves eager at its
# full speed until the load leaves room (docs/decisions/cpu-compile.md, "Once there is CPU to spare").
SPARE_SHARE = 0.25
SPARE_WINDOW_S = 10.0
SPARE_MAX_WAIT_S = 300.0


class SpareCpu:
    """Whether a pod's CPUs have had time to spare lately: fed the CPU seconds used so far with the
    time, it answers whether at least ``share`` of ``cpus`` went unused over the last ``window_s``.
    Pure: the clock and the use are passed in."""

    def __init__(self, cpus: float, share: float = SPARE_SHARE, window_s: float = SPARE_WINDOW_S) -> None:
        self._cpus = cpus
        self._share = share
        self._window = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (time, CPU seconds used so far), the window's

    def spare(self, used_s: float, now: float) -> bool:
        self._samples.append((now, used_s))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self._window:
            self._samples.popleft()
        at, used_then = self._samples[0]
        if now - at < self._window:
            return False  # not a whole window seen yet
        return 1 - (used_s - used_then) / (self._cpus * (now - at)) >= self._share


@dataclass(frozen=True)
class Served:
    """The forward a model serves with, and why."""

    forward: str  # EAGER, COMPILED or GRAPHS
    why: str


AS_LOADED = Served(EAGER, "as loaded")


def pending(asked: Toggle) -> Served:
    """What serves while the compile runs beside eager serving (:func:`kembed.engine.warmup.compile_while_serving`)."""
    return Served(EAGER, f"{env_name('compile')}={asked.value}: {COMPILING}")


def unmeasured(asked: Toggle, graphs: bool) -> Served:
    """The forward served where the CPU compile does not apply (``Queueing.compiles_forward``), and why."""
    if graphs:
        return Served(GRAPHS, f"{env_name('compile')}={asked.value}: fixed-shape graphs")
    if asked is Toggle.OFF:
        return Served(EAGER, f"{env_name('compile')}=off")
    return Served(EAGER, f"{env_name('compile')}={asked.value}: naive batching is never compiled")


def measured(
    asked: Toggle,
    shapes: Sequence[tuple[int, int]],
    eager_s: Sequence[float],
    compiled_s: Sequence[float],
    cosine: float,
) -> Served:
    """Once warmup has timed both forwards on the same (seq_len, rows) batches and compared their
    vectors: ``on`` serves compiled; ``auto`` compiled where accurate, at
    least ``MIN_SPEEDUP`` faster overall, and no shape under ``MIN_SHAPE_SPEEDUP``."""
    ratios = [eager / compiled if compiled > 0 else 0.0 for eager, compiled in zip(eager_s, compiled_s, strict=True)]
    overall = sum(eager_s) / sum(compiled_s) if sum(compiled_s) > 0 else 0.0
    each = ", ".join(f"{rows}x{seq_len} {ratio:.2f}x" for (seq_len, rows), ratio in zip(shapes, ratios, strict=True))
    figures = f"compiled {overall:.2f}x eager's speed ({each}), min cosine {cosine:.5f}"
    if asked is Toggle.ON:
        return Served(COMPILED, f"{env_name('compile')}=on: {figures}")
    if cosine < MIN_COSINE:
        return Served(EAGER, f"auto: {figures}, under {MIN_COSINE}")
    if overall < MIN_SPEEDUP or min(ratios) < MIN_SHAPE_SPEEDUP:
        return Served(EAGER, f"auto: {figures}: not {MIN_SPEEDUP}x overall and {MIN_SHAPE_SPEEDUP}x on every shape")
    return Served(COMPILED, f"auto: {figures}")


def as_kept(why: str, cosine: float) -> Served:
    """Compiled, as an earlier start measured and kept, where this start's vectors still match eager's."""
    if cosine < MIN_COSINE:
        return Served(EAGER, f"{why}; but min cosine {cosine:.5f} here, under {MIN_COSINE}")
    return Served(COMPILED, why)


def failed(error: BaseException) -> Served:
    """A compile that failed: eager serves, and the first line of the error says why."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return Served(EAGER, f"compile failed, serving eager: {type(error).__name__}: {first[:300]}")


# Dynamo specialises sizes 0 and 1: a batch of one-token rows would compile a graph of its own
# mid-serving (14.6 s on one batch). Shorter batches are padded to this length, which the masks hide.
MIN_LENGTH = 2


def padded_to_min_length(forward: Forward, pad_token_id: int) -> Forward:
    """``forward`` taking batches shorter than ``MIN_LENGTH`` padded to it: the padding's mask is 0,
    so attention and pooling (mean, first or last unmasked token) leave it out."""

    def padded(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        short = MIN_LENGTH - ids.shape[1]
        if short > 0:
            # Made as the batches the graphs were compiled on are (outside inference mode): dynamo
            # guards on an input's dispatch keys, and an inference tensor would compile again.
            with torch.inference_mode(False):
                ids = torch.nn.functional.pad(ids, (0, short), value=pad_token_id)
                mask = torch.nn.functional.pad(mask, (0, short), value=0)
        return forward(ids, mask)

    return padded


def compile_forward(forward: Forward, threads: int) -> Forward:
    """``forward`` compiled by inductor for any batch shape, its C++ kernels for ``threads`` threads.
    Compiles on its first call; an error raises there."""
    # Duck shaping would take rows and length for one size whenever the first batch has them equal,
    # and recompile at the next batch that does not.
    torch.fx.experimental._config.use_duck_shape = False
    options: dict[str, str | int | bool | Callable[..., Any]] = {"freezing": False, "cpp.threads": threads}
    return torch.compile(forward, dynamic=True, fullgraph=True, options=options)
