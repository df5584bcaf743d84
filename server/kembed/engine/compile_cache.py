"""``KEMBED_COMPILE_CACHE_DIR``: torch's compile caches kept across restarts, one folder per identity.

Inductor's FX-graph and autotuning caches go under ``TORCHINDUCTOR_CACHE_DIR`` and Triton's kernels
under ``TRITON_CACHE_DIR``, both set before the first compile. The folder is named by
a hash of what the compiled code depends on: torch and CUDA versions, the GPU, the model's files,
dtype, pooling, graph mode and the planned shapes, written out in a manifest. A folder written for
another identity is left alone and logged, never used: torch's own cache keys are the second line
of defence, not the only one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MANIFEST = "kembed-compile-cache.json"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"  # inductor puts it under its own unless already set: set it too
# What the compiled code depends on in a model folder; weight values are inputs, not constants.
_MODEL_FILES = ("config.json", "modules.json", "1_Pooling/config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")

Identity = dict[str, str]


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


def identity(
    device: torch.device, model: Path, dtype: torch.dtype, pooling: str, mode: str, shapes: Iterable[tuple[int, int]]
) -> Identity:
    return {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "device": device_name(device),
        "model": model_fingerprint(model),
        "dtype": str(dtype),
        "pooling": pooling,
        "graphs": mode,
        "shapes": ",".join(f"{rows}x{seq_len}" for seq_len, rows in sorted(shapes)),
    }


def cache_key(ident: Identity) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def differences(mine: Identity, theirs: Identity) -> list[str]:
    """The identity fields that differ, each with the value found."""
    return [
        f"{key} {theirs.get(key)!r}" for key in sorted(mine.keys() | theirs.keys()) if mine.get(key) != theirs.get(key)
    ]


def _read_manifest(path: Path) -> Identity | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def select(root: Path, ident: Identity) -> Path:
    """This identity's folder under ``root``, created; every other cache there is logged and ignored."""
    folder = root / cache_key(ident)
    for other in sorted(root.glob(f"*/{MANIFEST}")):
        if other.parent != folder:
            theirs = _read_manifest(other) or {}
            log.info("compile cache %s ignored: written with %s", other.parent, "; ".join(differences(ident, theirs)))
    found = _read_manifest(folder / MANIFEST)
    if found == ident:
        log.info("compile cache %s: reusing (torch %s, %s)", folder, ident["torch"], ident["device"])
        return folder
    if folder.exists():
        log.warning("compile cache %s: its manifest does not match its name; starting it afresh", folder)
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    partial = folder / f"{MANIFEST}.tmp"
    partial.write_text(json.dumps(ident, indent=1, sort_keys=True), encoding="utf-8")
    partial.replace(folder / MANIFEST)
    log.info("compile cache %s: new; this warmup fills it", folder)
    return folder


def use(root: str, ident: Identity) -> Path | None:
    """Point inductor and Triton at this identity's folder; call before compiling."""
    if not root:
        return None
    folder = select(Path(root), ident)
    os.environ[INDUCTOR_ENV] = str(folder / "inductor")
    os.environ[TRITON_ENV] = str(folder / "triton")
    import torch._inductor.config as inductor  # heavy: only when a cache is used

    # Without the FX-graph cache a warm restart recompiles everything (it is on by default).
    log.info("compile cache: inductor fx_graph_cache=%s", getattr(inductor, "fx_graph_cache", "absent"))
    return folder
