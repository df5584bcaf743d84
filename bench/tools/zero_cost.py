"""A ZERO-COST ENGINE, for measuring the host path only: never a server, never a default.

``python -m bench.tools.zero_cost`` runs ``python -m kembed`` exactly (supervisor, front ends, engine,
IPC, admission, buckets, batcher, responder; the real tokenizer and model info), except that the
engine's forward returns zeros at once. What it serves per second is what the host path can carry,
the figure ``bench.serving.hostpath`` sets beside a bare gRPC echo server.
"""

from __future__ import annotations

import logging
import sys

import torch

from kembed.__main__ import serve
from kembed.config.settings import Settings
from kembed.config.values import ConfigError
from kembed.engine.model import EmbeddingModel

LOADER = "bench.tools.zero_cost:ZeroCostModel.load"


class ZeroCostModel(EmbeddingModel):
    """The real model's tokenizer and limits; a forward that computes nothing."""

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros((ids.shape[0], self.info.dimensions), dtype=torch.float32)


def main() -> int:
    try:
        settings = Settings.from_env()
    except ConfigError as error:
        print(f"bench.tools.zero_cost: configuration error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print("bench.tools.zero_cost: the engine computes NOTHING (host-path measurement only)", flush=True)
    return serve(settings, LOADER)


if __name__ == "__main__":
    sys.exit(main())
