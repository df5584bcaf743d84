"""Auto's verdicts kept in ``KEMBED_COMPILE_CACHE_DIR``: measured once, read by every later start.

``KEMBED_DTYPE=auto`` and ``KEMBED_COMPILE=auto`` measure on a CPU (bf16 against fp32, compiled
against eager), and on shared cores the same machine measured bf16 at 0.78x fp32 on one start and
faster on another: two replicas of one service could serve different dtypes or forwards. So the
first start to measure a verdict keeps it in the compile cache root (the volume replicas mount),
under a name hashed from what the verdict depends on (the CPU's model and bf16 flags, torch, the
model's files, and what the verdict's kind adds), and every later start reads it instead of
measuring. A start measures under an exclusive ``flock`` of the verdict's lock file, so a replica
starting meanwhile waits and reads what the first one found, rather than measuring its own. Without
a root, or with one that cannot be locked or written, each start measures for itself.

To measure again (a new node pool of the same CPU model behaves otherwise), delete ``verdicts/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from kembed.engine import compile_cache, precision

log = logging.getLogger(__name__)

FOLDER = "verdicts"
Verdict = dict[str, str]


def cpu_model(cpuinfo: Path = precision.CPUINFO) -> str:
    """The CPU's model name (x86) or part number (Arm), "unknown" where the file does not say."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "CPU part"):
            return value.strip()
    return "unknown"


def identity(kind: str, model: Path, **more: str) -> compile_cache.Identity:
    """What a verdict of ``kind`` depends on: this CPU, torch, the model's files, and ``more``."""
    return {
        "kind": kind,
        "cpu": cpu_model(),
        "bf16_units": ",".join(precision.bf16_units()),
        "torch": torch.__version__,
        "model": compile_cache.model_fingerprint(model),
        **more,
    }


@dataclass
class Kept:
    """The verdict kept for an identity (``found``), or where to keep the one measured now."""

    found: Verdict | None
    path: Path | None  # None: nowhere to keep it
    ident: compile_cache.Identity

    def keep(self, verdict: Verdict) -> None:
        """Write the verdict measured (atomically: readers take no lock); a failure only logs."""
        if self.path is None:
            return
        partial = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex}.tmp")
        try:
            kept = {"identity": self.ident, "verdict": verdict}  # the identity for whoever reads the folder
            partial.write_text(json.dumps(kept, indent=1, sort_keys=True), encoding="utf-8")
            partial.replace(self.path)
        except OSError as error:
            log.error("verdict %s cannot be kept (%s): later starts measure again", self.path, error)
            return
        log.info("verdict kept in %s for later starts: %s", self.path, verdict)

    def read_why(self, why: str) -> str:
        """The reason of a verdict read rather than measured: says so, and where it was kept."""
        return f"as measured before ({self.path}): {why}"


def _read(path: Path) -> Verdict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))["verdict"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return {str(key): str(item) for key, item in value.items()} if isinstance(value, dict) else None


def _locked(path: Path) -> IO[bytes]:
    handle = path.open("a+b")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError:
        handle.close()
        raise
    return handle


@contextlib.contextmanager
def held(root: str, ident: compile_cache.Identity) -> Iterator[Kept]:
    """The verdict kept under ``root`` for ``ident``, its lock held for the block: a caller that
    finds none measures and :meth:`Kept.keep` s it before another start can read."""
    if not root:
        yield Kept(None, None, ident)
        return
    name = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    folder = Path(root) / FOLDER
    path = folder / f"{ident['kind']}-{name}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = _locked(folder / f"{path.stem}.lock")
    except OSError as error:
        log.error("verdicts cannot be kept in %s (%s): this start measures for itself", folder, error)
        yield Kept(None, None, ident)
        return
    with lock:
        found = _read(path)
        if found is not None:
            log.info("verdict read from %s (not measured): %s", path, found)
        yield Kept(found, path, ident)
