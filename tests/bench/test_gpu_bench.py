"""bench.compute.gpu: a clean "not run" without CUDA; on a GPU, start-ups that compiled whole graphs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.compute import gpu
from bench.tools import machine
from kembed.config.values import Graphs

CUDA = torch.cuda.is_available()


@pytest.mark.process
@pytest.mark.skipif(CUDA, reason="checks the path taken without CUDA")
def test_without_cuda_it_records_that_it_was_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "RESULTS_DIR", tmp_path)
    gpu.main(["--quick"])
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["run"] is False
    assert "CUDA" in result["reason"]
    assert result["machine"]["torch"] == torch.__version__


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_cold_then_warm_start_compiles_whole_graphs_and_gives_every_shape_one(tmp_path: Path) -> None:
    runs = gpu.startups("", tmp_path)
    for name, run in runs.items():
        assert "error" not in run, name
        assert run["sealed"] and run["shapes_with_graph"] == run["shapes"], name
        # An eager warmup compiles no graph and no kernel; a warm start loads its kernels from the cache.
        assert run["dynamo_graphs"] >= 1 and run["inductor_kernels"] >= 1 and run["graph_breaks"] == 0, name
        per_shape = run["dynamo_graphs_per_shape"]
        assert len(per_shape) == run["shapes"], name
        if name.startswith(Graphs.STATIC):
            assert set(per_shape.values()) == {1}, name  # dynamic=False: one graph per shape
        else:
            assert run["dynamo_graphs"] <= 2, name  # one dynamic graph, one for one-row batches
