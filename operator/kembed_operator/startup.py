"""The startupProbe budget, from cold-start figures per warmup mechanism rather than one guess.

Cold start = model load + warmup, and warmup costs something once and something per shape warmed;
both depend on how the server makes its graphs (``KEMBED_GRAPHS``, see ``kembed.engine.graphs``).
docs/operator.md ("Compile cache and the startup budget") tabulates the figures and their sources:

- ``static`` compiles every shape: on an H100 with torch 2.11, the 35 shapes of MiniLM's ladder
  compiled one by one in 174 s.
- ``capture`` (the default) compiles once with dynamic shapes, then captures a CUDA graph per shape.
  :data:`ASSUMED_CAPTURE` holds the only figures here that are assumed, not measured: replace them
  with a GPU's timings.
- eager (``KEMBED_COMPILE=off``, or ``batching: naive``) runs each bucket's largest batch.
- a CPU (``KEMBED_COMPILE`` auto or on) warms up eager: it compiles its forward once it serves
  (``kembed.engine.cpu_compile``), which readiness does not wait for.

A warm restart from the compile cache is faster still; the probe only bounds the slow case, and
``startupTimeoutSeconds`` overrides it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kembed.config.settings import Settings
from kembed.config.values import Graphs
from kembed.policy.shapes import BatchShapes, batch_tokens, compiles


@dataclass(frozen=True)
class WarmupCost:
    """Seconds a warmup takes: paid once, and per shape warmed."""

    once_s: float
    per_shape_s: float


# H100, torch 2.11, recompile limit raised: 35 shapes compiled in 174 s.
STATIC = WarmupCost(once_s=0.0, per_shape_s=174 / 35)
# ASSUMED, not measured. Once: the dynamic-shape compile and its one-row specialization, each taken
# as a few static compiles (about 5 s each above), with room to spare: 60 s. Per shape: two warm
# calls and one capture, milliseconds each, plus first-call allocations and autotuning: 1 s.
ASSUMED_CAPTURE = WarmupCost(once_s=60.0, per_shape_s=1.0)
# Eager warmup runs the largest batch of each bucket twice, about 0.4 s each on two CPU cores
# (kembed.policy.shapes.AUTO_MAX_TOKENS' comment); on a CPU with bf16 units KEMBED_DTYPE=auto runs them in
# fp32 and in bf16 (kembed.engine.precision): 2 s a bucket, rounded up.
EAGER = WarmupCost(once_s=0.0, per_shape_s=2.0)
# Model load and everything else before warmup, the larger of two H100 cold starts: ready 20 s
# after a 74 s warmup, and 12 s after a 174 s one.
LOAD_SECONDS = 20
# A slower GPU than an H100, a busy node: the probe must not kill a pod that is merely slow.
SAFETY_FACTOR = 2.0


def warmup_cost(settings: Settings, device_type: str) -> WarmupCost:
    """The mechanism the server will warm up with, as ``kembed.engine.graphs.compile_graphs`` picks it."""
    if not compiles(settings, device_type):
        return EAGER
    if settings.graphs is Graphs.CAPTURE and device_type == "cuda":
        return ASSUMED_CAPTURE
    return STATIC  # static: a compile per shape


def warmup_shapes(settings: Settings, device_type: str) -> int:
    """Shapes the server warms up: compiled, every (bucket, rows) shape; eager, one per bucket.

    An upper bound: the server also drops buckets longer than the model's input limit, which the
    operator does not know.
    """
    if not compiles(settings, device_type):
        return len(settings.buckets)
    shapes = BatchShapes.build(settings.max_batch_size, batch_tokens(settings, device_type), fixed=True)
    return len(shapes.grid(settings.buckets))


def startup_budget_seconds(settings: Settings, device_type: str) -> int:
    """How long a cold start may take before the startup probe gives up on the container."""
    cost = warmup_cost(settings, device_type)
    warmup = cost.once_s + cost.per_shape_s * warmup_shapes(settings, device_type)
    return math.ceil(SAFETY_FACTOR * (LOAD_SECONDS + warmup))
