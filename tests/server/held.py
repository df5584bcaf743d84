"""A TEST HARNESS, never a server: ``python -m tests.server.held`` runs ``python -m kembed`` exactly,
with the real model, except that the engine's forward waits while a hold file exists.

A test that needs work still in flight (a drain, a certificate rotation, rejections while the engine
computes) holds the engine instead of hoping a backlog outlasts its checks: on a fast machine a
backlog is gone before the checks run, on a slow one a sleep is too short. ``HELD_FILE`` (not a
``KEMBED_*`` name: those are the server's settings) names the file; :class:`EngineHold` manages it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import TracebackType

import torch

from kembed.__main__ import serve
from kembed.config.settings import Settings
from kembed.engine.model import EmbeddingModel

HOLD_ENV = "HELD_FILE"
LOADER = "tests.server.held:HeldModel.load"
POLL_S = 0.005


class HeldModel(EmbeddingModel):
    """The real model; each forward first waits while the hold file exists."""

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hold = Path(os.environ[HOLD_ENV])
        while hold.exists():
            time.sleep(POLL_S)
        return super().forward(ids, attention_mask)


class EngineHold:
    """The hold file: while held, every batch waits before it computes. ``with hold:`` holds and
    releases; ``release()`` may come earlier, inside the block."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def hold(self) -> None:
        self.path.touch()

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> EngineHold:
        self.hold()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()


if __name__ == "__main__":
    sys.exit(serve(Settings.from_env(), LOADER))
