"""The compile cache: its key, its accept-or-ignore decision, pruning, and two real processes sharing
one root as replicas on a ReadWriteMany volume do (no GPU needed)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kembed.engine import compile_cache, verdicts
from kembed.engine.compile_cache import MANIFEST, Identity, Manifest, cache_key, identity, select, shape_names

SHAPES = [(16, 1), (16, 2), (32, 1)]  # (seq_len, rows), as the worker plans them
BARRIER_S = 120.0  # a broken barrier fails the test instead of hanging it; generous for a busy machine
ROUNDS = 8


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 384}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def ident(model_dir: Path, **changes: str) -> Identity:
    return {**identity(torch.device("cpu"), model_dir, torch.bfloat16, "mean", "capture"), **changes}


class Clock:
    """Wall-clock seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


@pytest.fixture
def folders() -> Iterator[list[compile_cache.CacheFolder]]:
    """Folders a test selects, released (their shared locks dropped) afterwards."""
    held: list[compile_cache.CacheFolder] = []
    yield held
    for folder in held:
        folder.release()


def test_the_identity_names_torch_device_model_and_plan_but_not_the_shapes(model_dir: Path) -> None:
    found = ident(model_dir)
    assert found["torch"] == torch.__version__
    assert found["device"] == "cpu"
    assert "shapes" not in found
    assert cache_key(found) == cache_key(ident(model_dir))  # stable across calls
    assert shape_names(SHAPES) == ["1x16", "2x16", "1x32"]


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


def test_dtype_and_mode_are_in_the_key(model_dir: Path) -> None:
    base = identity(torch.device("cpu"), model_dir, torch.bfloat16, "mean", "capture")
    variants = [
        identity(torch.device("cpu"), model_dir, torch.float16, "mean", "capture"),
        identity(torch.device("cpu"), model_dir, torch.bfloat16, "mean", "static"),
        identity(torch.device("cpu"), model_dir, torch.bfloat16, "cls", "capture"),
    ]
    assert len({cache_key(base), *map(cache_key, variants)}) == 4


def test_a_cache_is_reused_by_the_same_identity(tmp_path: Path, model_dir: Path, folders: list[Any]) -> None:
    first = select(tmp_path / "cache", ident(model_dir), SHAPES)
    (first.path / "inductor").mkdir()
    folders += [first, select(tmp_path / "cache", ident(model_dir), SHAPES)]
    assert folders[1].path == first.path
    assert (first.path / "inductor").is_dir()  # kept
    assert folders[1].new_shapes == []


def test_new_buckets_reuse_the_folder_and_record_their_shapes(
    tmp_path: Path, model_dir: Path, folders: list[Any]
) -> None:
    root = tmp_path / "cache"
    folders.append(select(root, ident(model_dir), SHAPES))
    (folders[0].path / "inductor" / "shape-independent").mkdir(parents=True)
    folders.append(select(root, ident(model_dir), [(16, 1), (64, 1)]))
    assert folders[1].path == folders[0].path
    assert (folders[1].path / "inductor" / "shape-independent").is_dir()  # what the buckets do not change stays
    assert folders[1].new_shapes == ["1x64"]
    manifest = Manifest.read(folders[1].path)
    assert manifest is not None
    assert manifest.identity == ident(model_dir)
    assert manifest.shapes == sorted(["1x16", "2x16", "1x32", "1x64"])


def test_a_cache_from_another_torch_or_gpu_is_ignored_with_a_log_line(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture, folders: list[Any]
) -> None:
    root = tmp_path / "cache"
    folders.append(select(root, ident(model_dir, torch="2.11.0+cu130", device="NVIDIA H100 80GB HBM3 sm_90"), SHAPES))
    with caplog.at_level(logging.INFO, logger=compile_cache.__name__):
        folders.append(select(root, ident(model_dir), SHAPES))
    theirs, mine = (folder.path for folder in folders)
    assert mine != theirs and theirs.is_dir()
    assert not (mine / "inductor").exists()
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(ignored) == 1
    assert "device 'NVIDIA H100 80GB HBM3 sm_90'" in ignored[0] and "torch '2.11.0+cu130'" in ignored[0]
    assert "model '" not in ignored[0]  # only what differs


def test_a_folder_whose_manifest_disagrees_with_its_name_is_started_afresh_unless_in_use(
    tmp_path: Path, model_dir: Path, folders: list[Any]
) -> None:
    root = tmp_path / "cache"
    folder = select(root, ident(model_dir), SHAPES)
    (folder.path / "stale").write_text("x")
    Manifest(ident(model_dir, torch="0.0")).write(folder.path)
    folders.append(select(root, ident(model_dir), SHAPES))  # the first is still held: in use, so kept
    assert (folder.path / "stale").exists()
    folder.release()
    folders[0].release()
    Manifest(ident(model_dir, torch="0.0")).write(folder.path)
    folders.append(select(root, ident(model_dir), SHAPES))
    assert folders[1].path == folder.path
    assert not (folder.path / "stale").exists()
    manifest = Manifest.read(folder.path)
    assert manifest is not None and manifest.identity == ident(model_dir)


def test_only_the_most_recently_used_identities_are_kept_and_never_one_in_use(
    tmp_path: Path, model_dir: Path, folders: list[Any]
) -> None:
    root, clock = tmp_path / "cache", Clock()
    in_use = select(root, ident(model_dir, torch="1.0"), SHAPES, keep=2, now=clock)
    folders.append(in_use)
    for version in ("2.0", "3.0"):
        select(root, ident(model_dir, torch=version), SHAPES, keep=2, now=clock).release()
    (root / f"{compile_cache.PARTIAL_PREFIX}crashed").mkdir()  # a creation that never finished
    (root / "not-a-cache").mkdir()
    folders.append(select(root, ident(model_dir, torch="4.0"), SHAPES, keep=2, now=clock))
    # 4.0 (this one) and 3.0 (the most recent other) are kept, 2.0 is deleted, and 1.0, though older,
    # is kept because a process still holds it.
    assert torch_versions(root) == ["1.0", "3.0", "4.0"]
    assert sorted(entry.name for entry in root.iterdir() if not (entry / MANIFEST).exists()) == [
        compile_cache.LOCK,
        "not-a-cache",
    ]
    in_use.release()
    folders.append(select(root, ident(model_dir, torch="4.0"), SHAPES, keep=2, now=clock))
    assert torch_versions(root) == ["3.0", "4.0"]


def torch_versions(root: Path) -> list[str]:
    """The torch version of every identity folder under root."""
    manifests = [Manifest.read(entry) for entry in root.iterdir() if (entry / MANIFEST).exists()]
    return sorted(manifest.identity["torch"] if manifest else "unreadable" for manifest in manifests)


def test_use_points_inductor_at_the_identitys_folder(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (compile_cache.INDUCTOR_ENV, compile_cache.TRITON_ENV):
        monkeypatch.delenv(name, raising=False)
    assert compile_cache.use("", ident(model_dir), SHAPES) is None
    assert compile_cache.INDUCTOR_ENV not in os.environ
    folder = compile_cache.use(str(tmp_path), ident(model_dir), SHAPES)
    assert folder == tmp_path / cache_key(ident(model_dir))
    assert os.environ[compile_cache.INDUCTOR_ENV] == str(folder / "inductor")
    assert os.environ[compile_cache.TRITON_ENV] == str(folder / "triton")


def test_a_root_that_cannot_be_used_costs_only_the_cache(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (compile_cache.INDUCTOR_ENV, compile_cache.TRITON_ENV):
        monkeypatch.delenv(name, raising=False)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    assert compile_cache.use(str(not_a_folder), ident(model_dir), SHAPES) is None
    assert compile_cache.INDUCTOR_ENV not in os.environ
    assert any("cannot be used" in r.getMessage() for r in caplog.records)


# --- two replicas on one volume ------------------------------------------------------------------


def replica(
    root: Path,
    idents: list[Identity],
    shapes: list[tuple[int, int]],
    keep: int,
    barrier: Any,
    chosen: Any,
) -> None:
    """One replica's start-ups, in step with the other's: both choose (creating and pruning) at once,
    then check, while both still hold their folders, that theirs is whole and nobody deleted it."""
    try:
        start_ups(root, idents, shapes, keep, barrier, chosen)
    except BaseException:
        barrier.abort()  # the other replica stops waiting at once
        raise


def start_ups(
    root: Path, idents: list[Identity], shapes: list[tuple[int, int]], keep: int, barrier: Any, chosen: Any
) -> None:
    for round_, ident in enumerate(idents):
        barrier.wait(BARRIER_S)
        folder = select(root, ident, shapes, keep=keep)
        marker = folder.path / "inductor" / f"in-use-{os.getpid()}"
        marker.parent.mkdir(exist_ok=True)
        marker.write_text("compiled artefacts")
        chosen.put((round_, os.getpid(), str(folder.path)))
        barrier.wait(BARRIER_S)  # both now hold a folder; the other's choosing and pruning is done
        manifest = Manifest.read(folder.path)
        assert marker.exists(), f"round {round_}: {folder.path} was deleted while in use"
        assert manifest is not None and manifest.identity == ident, f"round {round_}: {manifest}"
        assert set(shape_names(shapes)) <= set(manifest.shapes), f"round {round_}: {manifest}"
        barrier.wait(BARRIER_S)
        folder.release()


def race(root: Path, plans: list[tuple[list[Identity], list[tuple[int, int]]]], keep: int) -> list[tuple[Any, ...]]:
    """Run one real process per plan (identities per round, shapes), all in step; what each chose."""
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter, as a second pod would be
    barrier, chosen = spawn.Barrier(len(plans)), spawn.Queue()
    processes = [
        spawn.Process(target=replica, args=(root, idents, shapes, keep, barrier, chosen)) for idents, shapes in plans
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(BARRIER_S * ROUNDS)
    assert [process.exitcode for process in processes] == [0] * len(plans)  # no exception in either
    return [chosen.get(timeout=BARRIER_S) for _ in range(sum(len(idents) for idents, _ in plans))]


@pytest.mark.process
def test_two_replicas_creating_the_same_folder_at_once_share_it(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "cache"
    idents = [ident(model_dir, torch=f"round-{n}") for n in range(ROUNDS)]  # a new folder every round
    results = race(root, [(idents, [(16, 1)]), (idents, [(16, 2)])], keep=2)
    for round_ in range(ROUNDS):
        assert len({path for r, _, path in results if r == round_}) == 1  # one folder, both replicas
    last = Manifest.read(root / cache_key(idents[-1]))
    assert last is not None and last.identity == idents[-1]
    assert last.shapes == ["1x16", "2x16"]  # neither replica's write lost the other's
    assert not [entry for entry in root.iterdir() if entry.name.startswith(compile_cache.PARTIAL_PREFIX)]
    assert len([entry for entry in root.iterdir() if (entry / MANIFEST).exists()]) <= 3  # keep 2, plus one in use


@pytest.mark.process
def test_two_replicas_of_different_identities_never_delete_each_others_folder(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "cache"
    mine, theirs = ident(model_dir, torch="A"), ident(model_dir, torch="B")
    # keep=1: each replica's every start would prune the other's folder, were it not in use.
    results = race(root, [([mine] * ROUNDS, SHAPES), ([theirs] * ROUNDS, SHAPES)], keep=1)
    assert {path for _, _, path in results} == {str(root / cache_key(mine)), str(root / cache_key(theirs))}
    for found in (Manifest.read(root / cache_key(ident)) for ident in (mine, theirs)):
        assert found is not None and found.shapes == sorted(shape_names(SHAPES))


def test_a_verdict_kept_by_one_start_is_read_by_the_next_of_the_same_identity(model_dir: Path, tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    mine = verdicts.identity("dtype", model_dir, cpus="2")
    with verdicts.held(root, mine) as first:
        assert first.found is None  # nothing kept yet: this start measures
        first.keep({"dtype": "float32", "why": "auto: bf16 0.78x fp32's speed"})
    with verdicts.held(root, mine) as later:
        assert later.found == {"dtype": "float32", "why": "auto: bf16 0.78x fp32's speed"}
        assert later.read_why("auto: x").startswith("as measured before (")
    with verdicts.held(root, {**mine, "torch": "9.9.9"}) as upgraded:
        assert upgraded.found is None  # another torch measures again
    with verdicts.held("", mine) as nowhere:
        nowhere.keep({"dtype": "bfloat16", "why": "auto"})  # no root: kept nowhere, no error
        assert nowhere.found is None


def test_a_start_measuring_holds_the_verdict_so_a_replica_starting_meanwhile_reads_it(
    model_dir: Path, tmp_path: Path
) -> None:
    mine = verdicts.identity("forward", model_dir, dtype="torch.float32", lane_threads="1")
    found: list[verdicts.Verdict | None] = []

    def replica() -> None:
        with verdicts.held(str(tmp_path), mine) as kept:
            found.append(kept.found)

    with verdicts.held(str(tmp_path), mine) as measuring:
        waiting = threading.Thread(target=replica)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()  # it waits on the lock rather than measuring for itself
        measuring.keep({"forward": "eager", "why": "auto: compiled 0.87x eager's speed"})
    waiting.join()
    assert found == [{"forward": "eager", "why": "auto: compiled 0.87x eager's speed"}]


def test_an_unusable_verdict_root_measures_for_itself(model_dir: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with verdicts.held(str(blocked), verdicts.identity("dtype", model_dir)) as kept:
        assert kept.found is None and kept.path is None


def test_the_cpu_model_is_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: fpu amx_bf16\n")
    assert verdicts.cpu_model(cpuinfo) == "Intel(R) Xeon(R) Platinum 8480+"
    assert verdicts.cpu_model(tmp_path / "absent") == "unknown"
