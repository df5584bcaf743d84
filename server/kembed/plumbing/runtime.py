"""The supervisor's runtime folder: the engine's socket, the board, the metrics files and what the
engine serves, in one folder under the temporary directory, with a lock file the supervisor holds (``flock``) for as
long as it lives.

A supervisor that was SIGKILLed leaves its folder behind, and in a pod ``/tmp`` is an emptyDir
that outlives container restarts, so every start removes the folders whose lock nobody holds.
A lock rather than a PID: the kernel drops it when its holder dies, however it dies, whereas a PID
is reused (a restarted container's supervisor may get its predecessor's) and means nothing in
another PID namespace. A folder without a lock file is not touched (it is not one of ours, or an
older kembed's, which would not have locked it), and neither is one being made: its lock file is
created under another name, locked, and only then renamed into place, so a lock file that exists
is locked by a living supervisor or by nobody. No lock is taken on the parent directory itself: on
a shared host anyone may lock ``/tmp``, and a start must not wait for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

PREFIX = "kembed-"
LOCK_FILE = "supervisor.lock"
NEW_LOCK_FILE = ".supervisor.lock.new"  # the lock file until it is locked
# What lives in it: the engine's socket front ends connect to, the board, prometheus-client's files.
ENGINE_SOCKET = "engine.sock"
BOARD_FILE = "board"
METRICS_DIR = "metrics"
SERVING_FILE = "serving.json"  # what the warm engine serves that is not a number: its dtype and why


class RuntimeDir:
    """A runtime folder, locked while this object lives; ``remove`` (or leaving ``with``) deletes it."""

    def __init__(self, path: Path, lock: int) -> None:
        self.path = path
        self._lock = lock

    @classmethod
    def create(cls, parent: Path | None = None) -> RuntimeDir:
        """Remove the folders their supervisors left behind, then make and lock a new one."""
        parent = parent or Path(tempfile.gettempdir())
        remove_stale(parent)
        path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))  # 0700: only this user can open its files
        lock = os.open(path / NEW_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # not inherited
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: nobody else can hold it
        os.rename(path / NEW_LOCK_FILE, path / LOCK_FILE)  # the same file, so the lock goes with it
        return cls(path, lock)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)

    def __enter__(self) -> RuntimeDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.remove()


def remove_stale(parent: Path) -> list[Path]:
    """Delete the runtime folders under ``parent`` whose supervisor is gone; the ones removed."""
    removed = []
    for path in sorted(parent.glob(f"{PREFIX}*")):
        # FileNotFoundError: no lock file, not ours; BlockingIOError: its supervisor lives.
        with contextlib.suppress(OSError), _locked(path / LOCK_FILE):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d runtime folders left by supervisors that are gone", len(removed))
    return removed


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock, or raise BlockingIOError at once if someone else holds it."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def write_serving(folder: Path, facts: dict[str, str]) -> None:
    """Publish what the warm engine serves (whole or not at all: readers never see half a file)."""
    partial = folder / f".{SERVING_FILE}"
    partial.write_text(json.dumps(facts))
    partial.replace(folder / SERVING_FILE)


def read_serving(folder: Path) -> dict[str, str]:
    """What the engine published; empty until it is warm."""
    try:
        return dict(json.loads((folder / SERVING_FILE).read_text()))
    except FileNotFoundError:
        return {}
