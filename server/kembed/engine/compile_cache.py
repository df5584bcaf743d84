"""``KEMBED_COMPILE_CACHE_DIR``: torch's compile caches kept across restarts, and shared by replicas.

Inductor's FX-graph and autotuning caches go under ``TORCHINDUCTOR_CACHE_DIR`` and Triton's kernels
under ``TRITON_CACHE_DIR``, both set before the first compile. Those caches key each entry on the
graph it was compiled from (its code, input shapes and dtypes, inductor's settings, the torch, Triton
and CUDA versions, the GPU), so one folder can hold the entries of many plans. The folder is named by
a hash of what changes *every* compiled graph: torch and CUDA versions, the GPU, the model's files,
dtype, pooling and graph mode (the *identity*, written out in a manifest). The planned batch shapes
change only some graphs (one per shape in static mode, barely any in capture mode), so they are
recorded in the manifest, not named: a new bucket ladder reuses what it shares with the old one. A
folder written for another identity is logged and never used: torch's own cache keys are the second
line of defence, not the only one.

The root may be a volume several replicas mount at once (a ReadWriteMany PVC):

- Choosing, creating and pruning folders happen under an exclusive ``fcntl.flock`` of ``.lock`` in the
  root, held for milliseconds; a folder appears under its name complete (written as ``.tmp-*``, then
  renamed), so no replica sees one half-made.
- A process holds a shared lock on its folder's ``.lock`` for as long as it runs. Pruning deletes a
  folder only under a non-blocking exclusive lock of it, so a folder in use is never deleted.
- The ``KEEP`` most recently used identities are kept; older ones, and ``.tmp-*`` folders (only a
  crash mid-creation leaves one), are deleted.
- Replicas compiling into one folder at once is safe: inductor and Triton write each entry to a
  temporary file and rename it into place.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

log = logging.getLogger(__name__)

MANIFEST = "kembed-compile-cache.json"
LOCK = ".lock"
PARTIAL_PREFIX = ".tmp-"
KEEP = 4  # identities kept in a root: a few models or GPU kinds sharing one volume, and the last upgrade
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"  # inductor puts it under its own unless already set: set it too
# What the compiled code depends on in a model folder; weight values are inputs, not constants.
_MODEL_FILES = ("config.json", "modules.json", "1_Pooling/config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")

Identity = dict[str, str]
Clock = Callable[[], float]
# Folders this process compiles with: their shared locks must last as long as the process.
_IN_USE: list[CacheFolder] = []


def device_name(device: torch.device) -> str:
    """The GPU's name and compute capability (kernels are built for both), or the device type."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


def model_fingerprint(folder: Path) -> str:
    """The model's configuration files' bytes and its weight files' names and sizes, hashed."""
    digest = hashlib.sha256()
    for name in _MODEL_FILES:
        path = folder / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES):
        digest.update(f"{path.relative_to(folder)}:{path.stat().st_size}\0".encode())
    return digest.hexdigest()[:16]


def identity(device: torch.device, model: Path, dtype: torch.dtype, pooling: str, mode: str) -> Identity:
    return {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "device": device_name(device),
        "model": model_fingerprint(model),
        "dtype": str(dtype),
        "pooling": pooling,
        "graphs": mode,
    }


def shape_names(shapes: Iterable[tuple[int, int]]) -> list[str]:
    """(seq_len, rows) shapes as sorted "ROWSxSEQ_LEN" names."""
    return [f"{rows}x{seq_len}" for seq_len, rows in sorted(set(shapes))]


def cache_key(ident: Identity) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def differences(mine: Identity, theirs: Identity) -> list[str]:
    """The identity fields that differ, each with the value found."""
    return [
        f"{key} {theirs.get(key)!r}" for key in sorted(mine.keys() | theirs.keys()) if mine.get(key) != theirs.get(key)
    ]


@dataclass
class Manifest:
    identity: Identity
    shapes: list[str] = field(default_factory=list)  # every shape warmed up with this folder
    last_used: float = 0.0  # wall-clock seconds: replicas on several nodes compare them

    @classmethod
    def read(cls, folder: Path) -> Manifest | None:
        """The folder's manifest, or None when it has none or one this version did not write."""
        try:
            value: Any = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            return cls(dict(value["identity"]), list(value["shapes"]), float(value["last_used"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def write(self, folder: Path) -> None:
        """Atomically: a reader that takes no lock sees the old manifest or the new one."""
        partial = folder / f"{MANIFEST}.{uuid.uuid4().hex}.tmp"
        partial.write_text(json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True), encoding="utf-8")
        partial.replace(folder / MANIFEST)


@dataclass
class CacheFolder:
    """A folder this process compiles with, held (shared lock) until :meth:`release`."""

    path: Path
    new_shapes: list[str]  # planned shapes no earlier start warmed up here: they compile cold
    _lock: IO[bytes]

    def release(self) -> None:
        self._lock.close()


def _lock(path: Path, kind: int) -> IO[bytes]:
    """``path`` opened (created if need be) and flock-ed, waiting for the lock."""
    handle = path.open("a+b")
    fcntl.flock(handle, kind)
    return handle


def _lock_now(path: Path) -> IO[bytes] | None:
    """``path`` opened and exclusively flock-ed, or None at once if anyone else holds a lock on it."""
    handle = path.open("a+b")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _create(root: Path, folder: Path, ident: Identity) -> None:
    """The folder, made complete under another name and renamed into place."""
    partial = root / f"{PARTIAL_PREFIX}{uuid.uuid4().hex}"
    partial.mkdir()
    (partial / LOCK).touch()
    Manifest(ident).write(partial)
    partial.rename(folder)


def _delete_unless_in_use(folder: Path) -> bool:
    handle = _lock_now(folder / LOCK)
    if handle is None:
        return False
    with handle:
        shutil.rmtree(folder)
    return True


def _prepare_folder(root: Path, folder: Path, ident: Identity) -> Manifest:
    """This identity's folder, reused, made, or started afresh if its manifest disagrees with its
    name and no one uses it; its manifest. Under the root's lock."""
    found = Manifest.read(folder)
    if found is not None and found.identity == ident:
        log.info("compile cache %s: reusing (torch %s, %s)", folder, ident["torch"], ident["device"])
        return found
    if folder.exists():
        if not _delete_unless_in_use(folder):
            log.warning("compile cache %s: its manifest does not match its name and it is in use; kept", folder)
            return Manifest(ident)
        log.warning("compile cache %s: its manifest did not match its name; started afresh", folder)
    _create(root, folder, ident)
    log.info("compile cache %s: new; this warmup fills it", folder)
    return Manifest(ident)


def _prune(root: Path, mine: Path, ident: Identity, keep: int) -> None:
    """Delete leftovers of crashed creations, and identities beyond the ``keep`` most recently used
    (this one counts) that no process uses. Under the root's lock, so no creation is under way."""
    others: list[tuple[float, Path]] = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry == mine:
            continue
        if entry.name.startswith(PARTIAL_PREFIX):
            shutil.rmtree(entry)
            continue
        if not (entry / MANIFEST).exists():
            continue  # not ours: left alone
        theirs = Manifest.read(entry)
        if theirs is not None:
            log.info("compile cache %s ignored: written with %s", entry, "; ".join(differences(ident, theirs.identity)))
        others.append((theirs.last_used if theirs else 0.0, entry))
    for _, entry in sorted(others, reverse=True)[max(keep - 1, 0) :]:
        if _delete_unless_in_use(entry):
            log.info("compile cache %s: deleted (more than %d identities, least recently used)", entry, keep)
        else:
            log.info("compile cache %s: past the %d most recently used, but in use; kept", entry, keep)


def select(
    root: Path, ident: Identity, shapes: Iterable[tuple[int, int]], keep: int = KEEP, now: Clock = time.time
) -> CacheFolder:
    """This identity's folder under ``root``, created if new and held until released; the planned
    ``shapes`` are recorded in its manifest, and identities beyond ``keep`` pruned."""
    root.mkdir(parents=True, exist_ok=True)
    folder = root / cache_key(ident)
    planned = shape_names(shapes)
    with _lock(root / LOCK, fcntl.LOCK_EX):
        manifest = _prepare_folder(root, folder, ident)
        held = _lock(folder / LOCK, fcntl.LOCK_SH)  # never waits: pruners lock under the root lock we hold
        new_shapes = sorted(set(planned) - set(manifest.shapes))
        Manifest(ident, sorted(set(manifest.shapes) | set(planned)), now()).write(folder)
        _prune(root, folder, ident, keep)
    if new_shapes and manifest.shapes:
        log.info("compile cache %s: %d of %d planned shapes are new here", folder, len(new_shapes), len(planned))
    return CacheFolder(folder, new_shapes, held)


def use(root: str, ident: Identity, shapes: Iterable[tuple[int, int]]) -> Path | None:
    """Point inductor and Triton at this identity's folder, held for the life of the process; call
    before compiling. A root that cannot be used (read-only, a volume without flock) only costs the
    cache: start-up compiles cold rather than failing."""
    if not root:
        return None
    try:
        folder = select(Path(root), ident, shapes)
    except OSError as error:
        log.error("compile cache %s cannot be used (%s); compiling without it", root, error)
        return None
    _IN_USE.append(folder)
    os.environ[INDUCTOR_ENV] = str(folder.path / "inductor")
    os.environ[TRITON_ENV] = str(folder.path / "triton")
    import torch._inductor.config as inductor  # heavy: only when a cache is used

    # Without the FX-graph cache a warm restart recompiles everything (it is on by default).
    log.info("compile cache: inductor fx_graph_cache=%s", getattr(inductor, "fx_graph_cache", "absent"))
    return folder.path
