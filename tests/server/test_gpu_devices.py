"""CUDA devices and streams: one side stream for every capture, and a model on a device other than
cuda:0 captured and replayed there. Apart from test_gpu.py, whose module-scoped engines a
``torch.compiler.reset()`` here would invalidate.

Skipped without a GPU (CI has none); the second needs two.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kembed.config.settings import Settings
from kembed.config.values import Graphs
from kembed.engine import graphs
from kembed.engine.model import EmbeddingModel
from kembed.engine.warmup import start_runner, warmup_batch
from tests.server.test_gpu import PLAN, batch, planned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_capture_uses_one_side_stream_for_every_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[torch.cuda.Stream] = []

    class CountedStream(torch.cuda.Stream):
        def __new__(cls, device=None, priority=0, **kwargs):
            stream = super().__new__(cls, device, priority, **kwargs)
            if "stream_id" not in kwargs:  # a new stream, not current_stream() wrapping an existing one
                made.append(stream)
            return stream

    monkeypatch.setattr(torch.cuda, "Stream", CountedStream)
    device = torch.device("cuda", torch.cuda.current_device())
    guard = graphs.compile_graphs(lambda ids, mask: (ids * mask).sum(dim=1), Graphs.CAPTURE, 3, device)
    try:
        generator = torch.Generator().manual_seed(0)
        for rows in (4, 2, 1):
            ids, mask = warmup_batch(rows, 16, 1000, 0, generator)
            guard(ids.to(device), mask.to(device))
    finally:
        torch.compiler.reset()
    assert len(guard.shapes) == 3
    assert len(made) == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_a_model_on_another_device_captures_and_replays_there() -> None:
    """Without torch.cuda.set_device, captures ran against cuda:0's current stream."""
    index = torch.cuda.device_count() - 1
    settings = Settings.from_env({}, device=f"cuda:{index}", compile="on", graphs="capture", **PLAN)
    previous = torch.cuda.current_device()
    try:
        engine = start_runner(settings, EmbeddingModel.load, lambda: None)
        assert torch.cuda.current_device() == index
        reference = EmbeddingModel.load(Settings.from_env({}, device="cpu", dtype="float32"))
        for seed, (rows, seq_len) in enumerate(planned(engine)):
            ids, mask = batch(rows, seq_len, seed)
            with torch.inference_mode():
                served, eager = engine._pooled(ids, mask), reference.forward(ids, mask).numpy()
            cos = np.sum(served * eager, 1) / np.linalg.norm(served, axis=1) / np.linalg.norm(eager, axis=1)
            assert cos.min() > 0.999, (rows, seq_len)
    finally:
        torch.cuda.set_device(previous)
        torch.compiler.set_stance("default")
        torch.compiler.reset()
