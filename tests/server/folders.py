"""Folders the corpus command cannot write to, made for real rather than mocked: a tmpfs mounted
read-only, or small enough to fill, where this machine lets the tests mount one (as root); a folder
without write permission otherwise (a non-root user). Where neither works, the test is skipped."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def _mount(folder: Path, options: str) -> bool:
    """Whether a tmpfs with ``options`` is now mounted on ``folder``."""
    if shutil.which("mount") is None:
        return False
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)]
    return subprocess.run(command, capture_output=True, timeout=60).returncode == 0


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def unwritable_folder(folder: Path) -> Iterator[str]:
    """``folder``, made so no file can be created in it; yields the error's text (``os.strerror``)
    a write meets: EROFS from a read-only tmpfs, else EACCES from its permissions."""
    folder.mkdir(parents=True, exist_ok=True)
    if _mount(folder, "ro,size=64k"):
        try:
            yield os.strerror(errno.EROFS)
        finally:
            _unmount(folder)
    elif os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield os.strerror(errno.EACCES)
        finally:
            folder.chmod(0o755)
    else:
        pytest.skip("root, and not allowed to mount a tmpfs: no folder here that root cannot write to")


@contextlib.contextmanager
def small_folder(folder: Path, size: str) -> Iterator[Callable[[str], None]]:
    """``folder`` as a tmpfs of ``size`` (``mount``'s notation: ``48k``); yields a function that
    grows it to another size, as freeing space would."""
    folder.mkdir(parents=True, exist_ok=True)
    if not _mount(folder, f"size={size}"):
        pytest.skip("not allowed to mount a tmpfs here: no disk to fill")

    def grow(to: str) -> None:
        command = ["mount", "-o", f"remount,size={to}", str(folder)]
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    try:
        yield grow
    finally:
        _unmount(folder)
