"""CUDA paths: every planned shape is compiled and replayed as a CUDA graph, none runs eager, and
nothing recompiles after warmup. The plan here (12 shapes) is larger than dynamo's default
recompile limit (8), the case that used to fall back to eager silently. Launch counts cannot tell a
compiled forward's graph from an eager one's, so what warmup compiled is counted too.

Skipped without a GPU (CI has none); run on a GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kembed.config.settings import Settings
from kembed.config.values import Graphs
from kembed.engine.graphs import CompileCount, UnplannedShapeError
from kembed.engine.model import EmbeddingModel
from kembed.engine.runner import ModelRunner
from kembed.engine.warmup import start_runner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PLAN = {"buckets": "16,32,64", "max_batch_size": 8, "max_tokens_per_batch": 512}
# A graph replay launches the graph plus a handful of kernels around it (the dtype cast of the
# output); MiniLM run eager launches well over a hundred.
MOST_KERNELS_BESIDE_A_GRAPH = 8


@pytest.fixture(scope="module", params=["capture", "static"])
def engine(request: pytest.FixtureRequest) -> Iterator[ModelRunner]:
    settings = Settings.from_env({}, device="cuda", compile="on", graphs=request.param, **PLAN)
    yield start_runner(settings, EmbeddingModel.load, lambda: None)
    torch.compiler.set_stance("default")  # sealing forbade recompiles process-wide
    torch.compiler.reset()


def planned(engine: ModelRunner) -> list[tuple[int, int]]:
    return [(rows, seq_len) for seq_len, rows in engine.plan.shapes.grid(engine.plan.bucket_lengths)]


def batch(rows: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids, right-padded to random lengths (padding must be masked in the graph too)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (rows, seq_len), generator=generator, dtype=torch.int32)
    lengths = torch.randint(1, seq_len + 1, (rows,), generator=generator)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).to(torch.int32)
    return ids * mask, mask


def launches(engine: ModelRunner, rows: int, seq_len: int) -> Counter[str]:
    """CUDA runtime and driver launch calls made by one batch of this shape."""
    from torch.profiler import ProfilerActivity, profile

    ids, mask = batch(rows, seq_len, seed=0)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine._pooled(ids, mask)
    return Counter(event.name for event in prof.events() if "Launch" in event.name)


def test_every_planned_shape_has_a_graph_and_replays_it_rather_than_running_eager(engine: ModelRunner) -> None:
    shapes = planned(engine)
    assert len(shapes) > torch._dynamo.config._config["recompile_limit"].default  # type: ignore[attr-defined]
    assert engine.graphs is not None and engine.graphs.sealed
    assert engine.graphs.shapes == set(shapes)
    for rows, seq_len in shapes:
        calls = launches(engine, rows, seq_len)
        graphs = sum(n for name, n in calls.items() if "GraphLaunch" in name)  # names may carry a _vNNNN
        kernels = sum(n for name, n in calls.items() if "LaunchKernel" in name)
        assert graphs >= 1, f"{rows}x{seq_len} replayed no graph: {calls}"
        assert kernels <= MOST_KERNELS_BESIDE_A_GRAPH, f"{rows}x{seq_len} ran eager: {calls}"


def test_warmup_compiled_whole_graphs_with_inductor_kernels(
    engine: ModelRunner, request: pytest.FixtureRequest
) -> None:
    assert engine.graphs is not None
    compiles = engine.graphs.compiles
    compiled = CompileCount.total(compiles.values())
    assert compiled.graphs >= 1 and compiled.kernels >= 1 and compiled.graph_breaks == 0, compiled
    if request.node.callspec.params["engine"] == Graphs.STATIC:
        assert all(count.graphs == 1 for count in compiles.values()), compiles  # dynamic=False: one a shape
    else:
        assert compiled.graphs <= 2, compiles  # one dynamic graph, and one for one-row batches


def test_no_recompiles_after_warmup_and_outputs_match_fp32(engine: ModelRunner) -> None:
    reference = EmbeddingModel.load(Settings.from_env({}, device="cpu", dtype="float32"))
    compiled = CompileCount.now()
    with torch.inference_mode():
        for seed, (rows, seq_len) in enumerate(planned(engine) * 2):
            ids, mask = batch(rows, seq_len, seed)
            served = engine._pooled(ids, mask)
            eager = reference.forward(ids, mask).numpy()
            cos = np.sum(served * eager, 1) / np.linalg.norm(served, axis=1) / np.linalg.norm(eager, axis=1)
            assert cos.min() > 0.999, (rows, seq_len)
    assert CompileCount.now() == compiled


def test_an_unplanned_shape_is_refused_not_compiled(engine: ModelRunner) -> None:
    ids, mask = batch(3, 16, seed=0)  # 3 rows: batch sizes are powers of two
    with pytest.raises(UnplannedShapeError), torch.inference_mode():
        engine._pooled(ids, mask)
