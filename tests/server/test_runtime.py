"""Runtime folders: a supervisor's is removed by the next start once its owner is gone, however it
died, and never while its owner lives. Owners here are real processes, killed for real."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kembed.plumbing.runtime import LOCK_FILE, NEW_LOCK_FILE, PREFIX, RuntimeDir, remove_stale

OWNER = "import sys; from pathlib import Path; from kembed.plumbing.runtime import RuntimeDir; " + (
    "print(RuntimeDir.create(Path(sys.argv[1])).path, flush=True); sys.stdin.read()"
)


class Owner:
    """A process that made a runtime folder under ``parent`` and holds it until it dies."""

    def __init__(self, parent: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", OWNER, str(parent)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.folder = Path(self.process.stdout.readline().strip())

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def owners(tmp_path: Path) -> Iterator[list[Owner]]:
    started: list[Owner] = []
    yield started
    for owner in started:
        owner.kill()


@pytest.mark.process
def test_only_folders_whose_owner_is_gone_are_removed(tmp_path: Path, owners: list[Owner]):
    owners += [Owner(tmp_path), Owner(tmp_path)]
    dead, alive = owners
    (dead.folder / "board").write_bytes(b"\0" * 8)
    dead.kill()
    foreign = tmp_path / f"{PREFIX}not-ours"  # no lock file: not a supervisor's folder
    foreign.mkdir()
    assert remove_stale(tmp_path) == [dead.folder]
    assert not dead.folder.exists()
    assert (alive.folder / LOCK_FILE).exists() and foreign.exists()


@pytest.mark.process
def test_a_new_folder_replaces_the_stale_ones_and_goes_with_its_owner(tmp_path: Path, owners: list[Owner]):
    owners.append(Owner(tmp_path))
    owners[0].kill()
    with RuntimeDir.create(tmp_path) as runtime:
        assert list(tmp_path.iterdir()) == [runtime.path]
        assert remove_stale(tmp_path) == []  # held by this process
    assert list(tmp_path.iterdir()) == []


def test_another_users_lock_on_the_parent_cannot_block_a_start(tmp_path: Path):
    # Anyone who can open /tmp can flock it: a start must not wait for the lock on the parent itself.
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(parent, fcntl.LOCK_EX)
    try:
        with ThreadPoolExecutor(1) as pool:
            made = pool.submit(RuntimeDir.create, tmp_path)
            runtime = made.result(timeout=60)  # only bounds a failure: a blocked start never returns
        assert (runtime.path / LOCK_FILE).exists()
        runtime.remove()
    finally:
        os.close(parent)


def test_a_folder_still_being_made_is_not_removed(tmp_path: Path):
    # Its lock file is locked under another name before it is renamed into place.
    being_made = tmp_path / f"{PREFIX}being-made"
    being_made.mkdir()
    (being_made / NEW_LOCK_FILE).touch()
    assert remove_stale(tmp_path) == []
    assert being_made.exists()
