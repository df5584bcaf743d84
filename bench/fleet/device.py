"""A MODELED DEVICE, for the fleet bench only: never a server, never a default.

``python -m bench.fleet.device`` runs ``python -m kembed`` exactly (supervisor, front ends, engine,
admission, buckets, batcher, metrics; the real tokenizer, the real weights loaded at start), except
that the engine's forward sleeps for the time a device would take for the batch and returns zero
vectors. ``time.sleep`` releases the GIL and spends no CPU, so every replica has a device of its own
however few cores the machine has. The time is ``overhead_s + per_token_s x padded tokens``
(``FLEET_DEVICE_COST``), a line fitted to a measured batch curve (:func:`fit`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kembed.__main__ import serve
from kembed.config.settings import Settings
from kembed.config.values import ConfigError
from kembed.engine.model import EmbeddingModel

LOADER = "bench.fleet.device:ModeledModel.load"
COST_VAR = "FLEET_DEVICE_COST"  # "overhead_s,per_token_s"


@dataclass(frozen=True)
class Cost:
    """Seconds a batch takes on the modeled device: affine in its padded tokens."""

    overhead_s: float
    per_token_s: float

    def seconds(self, rows: int, length: int) -> float:
        return self.overhead_s + self.per_token_s * rows * length

    def slowed(self, factor: float) -> Cost:
        return Cost(self.overhead_s * factor, self.per_token_s * factor)

    def env(self) -> str:
        return f"{self.overhead_s!r},{self.per_token_s!r}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Cost:
        overhead, per_token = (float(x) for x in environ[COST_VAR].split(","))
        return cls(overhead, per_token)


def fit(points: Sequence[Mapping[str, Any]]) -> Cost:
    """Least squares of a batch's seconds (tokens / tokens_per_s) on its padded tokens, over a batch
    curve's points (``bench.compute.ceiling``'s ``batch_curve``)."""
    xs = [float(p["tokens"]) for p in points]
    ys = [float(p["tokens"]) / float(p["tokens_per_s"]) for p in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return Cost(max(0.0, my - slope * mx), slope) if n > 1 else Cost(0.0, ys[0] / xs[0])


@functools.cache
def _cost() -> Cost:
    """Read in the engine's process (spawned: the environment is what crosses over)."""
    return Cost.from_env(os.environ)


class ModeledModel(EmbeddingModel):
    """The real model's tokenizer, limits and weights; a forward that waits out the modeled device."""

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        time.sleep(_cost().seconds(int(ids.shape[0]), int(ids.shape[1])))
        return torch.zeros((ids.shape[0], self.info.dimensions), dtype=torch.float32)


def main() -> int:
    try:
        settings = Settings.from_env()
        cost = _cost()
    except (ConfigError, KeyError, ValueError) as error:
        print(f"bench.fleet.device: configuration error: {error!r} (and {COST_VAR})", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"bench.fleet.device: a MODELED device ({cost}), zero vectors", flush=True)
    return serve(settings, LOADER)


if __name__ == "__main__":
    sys.exit(main())
