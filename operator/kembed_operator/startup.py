"""The startupProbe budget, from measured cold-start figures rather than a guess.

Cold start = model load + warmup, and warmup grows with the shapes the server warms. The per-shape
figure is the one measured for compiled warmup on an H100 with torch 2.11 (``../shared/GPU.md``): all
35 shapes of the default ladder compiled one by one in 174 s. The faster ``KEMBED_GRAPHS=capture``
has not been measured yet, so the budget assumes the measured (slower) mechanism. A warm restart
from the compile cache is faster still; the probe only bounds the slow case.
"""

from __future__ import annotations

import math

from kembed.config import Settings
from kembed.shapes import BatchShapes, batch_tokens, compiles

# H100, torch 2.11, recompile limit raised: 35 shapes compiled in 174 s (GPU.md).
COMPILED_SECONDS_PER_SHAPE = 174 / 35
# Eager warmup runs the largest batch of each bucket twice, about 0.4 s each on two CPU cores
# (kembed.shapes.AUTO_MAX_TOKENS' comment): 1 s a bucket, rounded up.
EAGER_SECONDS_PER_SHAPE = 1.0
# Model load and everything else before warmup: ready 20 s after a 74 s warmup, and 12 s after a
# 174 s one (GPU.md); the larger.
LOAD_SECONDS = 20
# A slower GPU than an H100, a busy node: the probe must not kill a pod that is merely slow.
SAFETY_FACTOR = 2.0


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
    per_shape = COMPILED_SECONDS_PER_SHAPE if compiles(settings, device_type) else EAGER_SECONDS_PER_SHAPE
    return math.ceil(SAFETY_FACTOR * (LOAD_SECONDS + per_shape * warmup_shapes(settings, device_type)))
