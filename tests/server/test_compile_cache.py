"""The compile cache's key and its accept-or-ignore decision (no GPU needed)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kembed.engine import compile_cache
from kembed.engine.compile_cache import MANIFEST, Identity, cache_key, identity, select

SHAPES = [(16, 1), (16, 2), (32, 1)]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 384}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def ident(model_dir: Path, **changes: str) -> Identity:
    return {**identity(torch.device("cpu"), model_dir, torch.bfloat16, "mean", "capture", SHAPES), **changes}


def test_the_identity_names_torch_device_model_and_plan(model_dir: Path) -> None:
    found = ident(model_dir)
    assert found["torch"] == torch.__version__
    assert found["device"] == "cpu"
    assert found["shapes"] == "1x16,2x16,1x32"
    assert cache_key(found) == cache_key(ident(model_dir))  # stable across calls


@pytest.mark.parametrize(
    "change",
    [
        lambda d: (d / "config.json").write_text(json.dumps({"hidden_size": 768})),
        lambda d: (d / "model.safetensors").write_bytes(b"\0" * 65),
        lambda d: (d / "extra.bin").write_bytes(b"\0"),
    ],
    ids=["config", "weights-size", "weights-file"],
)
def test_a_different_model_gets_a_different_key(model_dir: Path, change: Callable[[Path], object]) -> None:
    before = cache_key(ident(model_dir))
    change(model_dir)
    assert cache_key(ident(model_dir)) != before


def test_plan_dtype_and_mode_are_in_the_key(model_dir: Path) -> None:
    base = identity(torch.device("cpu"), model_dir, torch.bfloat16, "mean", "capture", SHAPES)
    variants = [
        identity(torch.device("cpu"), model_dir, torch.float16, "mean", "capture", SHAPES),
        identity(torch.device("cpu"), model_dir, torch.bfloat16, "mean", "static", SHAPES),
        identity(torch.device("cpu"), model_dir, torch.bfloat16, "mean", "capture", SHAPES[:2]),
    ]
    assert len({cache_key(base), *map(cache_key, variants)}) == 4


def test_a_cache_is_reused_by_the_same_identity(tmp_path: Path, model_dir: Path) -> None:
    first = select(tmp_path / "cache", ident(model_dir))
    (first / "inductor").mkdir()
    assert select(tmp_path / "cache", ident(model_dir)) == first
    assert (first / "inductor").is_dir()  # kept


def test_a_cache_from_another_torch_or_gpu_is_ignored_with_a_log_line(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cache"
    theirs = select(root, ident(model_dir, torch="2.11.0+cu130", device="NVIDIA H100 80GB HBM3 sm_90"))
    with caplog.at_level(logging.INFO, logger=compile_cache.__name__):
        mine = select(root, ident(model_dir))
    assert mine != theirs
    assert not (mine / "inductor").exists()
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(ignored) == 1
    assert "device 'NVIDIA H100 80GB HBM3 sm_90'" in ignored[0] and "torch '2.11.0+cu130'" in ignored[0]
    assert "model '" not in ignored[0]  # only what differs


def test_a_folder_whose_manifest_disagrees_with_its_name_is_started_afresh(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "cache"
    folder = select(root, ident(model_dir))
    (folder / "stale").write_text("x")
    (folder / MANIFEST).write_text(json.dumps(ident(model_dir, torch="0.0")))
    assert select(root, ident(model_dir)) == folder
    assert not (folder / "stale").exists()
    assert json.loads((folder / MANIFEST).read_text()) == ident(model_dir)


def test_use_points_inductor_at_the_identitys_folder(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (compile_cache.INDUCTOR_ENV, compile_cache.TRITON_ENV):
        monkeypatch.delenv(name, raising=False)
    assert compile_cache.use("", ident(model_dir)) is None
    assert compile_cache.INDUCTOR_ENV not in os.environ
    folder = compile_cache.use(str(tmp_path), ident(model_dir))
    assert folder == tmp_path / cache_key(ident(model_dir))
    assert os.environ[compile_cache.INDUCTOR_ENV] == str(folder / "inductor")
    assert os.environ[compile_cache.TRITON_ENV] == str(folder / "triton")
