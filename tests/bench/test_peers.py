"""bench.serving.peers without Infinity's venv: what it serves, where, and its refusal of a CUDA torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.serving import peers


def test_it_serves_the_bundled_model_on_loopback_offline(tmp_path: Path) -> None:
    model = peers.model_dir()
    modules = json.loads((model / "modules.json").read_text())
    assert [m["type"] for m in modules][:2] == ["sentence_transformers.models.Transformer",
                                                "sentence_transformers.models.Pooling"]  # fmt: skip
    assert (model / "model.safetensors").is_file()
    argv = peers.infinity_argv(tmp_path / "infinity_emb", model, 8123)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--url-prefix") + 1] == "/v1"
    env = peers.offline_env(tmp_path)
    assert (env["HF_HUB_OFFLINE"], env["INFINITY_HOME"]) == ("1", str(tmp_path))


def _venv_reporting(venv: Path, versions: str) -> Path:
    """A stand-in for an installed venv (tests must not need Infinity's): its python prints ``versions``."""
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "infinity_emb").touch()
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho {versions}\n")
    python.chmod(0o755)
    return venv


@pytest.mark.process
def test_setup_keeps_a_cpu_torch_and_refuses_a_cuda_one(tmp_path: Path) -> None:
    cpu = _venv_reporting(tmp_path / "cpu", "2.13.0+cpu None 0.0.78")
    assert peers.setup(cpu) == cpu / "bin" / "infinity_emb"
    cuda = _venv_reporting(tmp_path / "cuda", "2.13.0+cu128 12.8 0.0.78")
    with pytest.raises(RuntimeError, match="CUDA torch"):
        peers.setup(cuda)
