"""bench.gpu: a clean "not run" without CUDA; on a GPU, a start-up with no eager fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gpu, machine

CUDA = torch.cuda.is_available()


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
def test_a_cold_then_warm_start_gives_every_shape_a_graph(tmp_path: Path) -> None:
    runs = gpu.startups("", tmp_path)
    for name, run in runs.items():
        assert "error" not in run, name
        assert run["eager_fallbacks"] == 0 and run["sealed"], name
        assert run["shapes_with_graph"] == run["shapes"], name
