"""CUDA paths: compiled CUDA graphs are captured during warmup and never recompiled afterwards.

Skipped without a GPU (CI has none); run on a GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kembed.config import Settings, Warmup
from kembed.engine.model import EmbeddingModel
from kembed.engine.worker import Engine, make_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_no_recompiles_after_warmup_and_outputs_match_eager():
    from torch._dynamo.utils import counters

    settings = Settings.from_env(
        {}, device="cuda", compile="on", buckets="16,32,64", max_batch_size=8, max_tokens_per_batch=512
    )
    model = EmbeddingModel.load(settings)
    plan = make_plan(settings, model)
    assert plan.compiled
    assert plan.shapes.fixed
    reference = EmbeddingModel.load(Settings.from_env({}, device="cpu", dtype="float32"))
    model.compile()
    engine = Engine(model, plan, Warmup.AUTO)
    with torch.inference_mode():
        engine.warm_up(lambda: None)
        graphs_after_warmup = counters["stats"]["unique_graphs"]
        generator = torch.Generator().manual_seed(1)
        for seq_len, rows in plan.shapes.grid(plan.bucket_lengths) * 2:
            ids = torch.randint(1000, 20000, (rows, seq_len), generator=generator, dtype=torch.int32)
            mask = torch.ones_like(ids)
            compiled = engine._pooled(ids, mask)
            eager = reference.forward(ids, mask).numpy()
            cos = np.sum(compiled * eager, 1) / np.linalg.norm(compiled, axis=1) / np.linalg.norm(eager, axis=1)
            assert cos.min() > 0.999
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup
