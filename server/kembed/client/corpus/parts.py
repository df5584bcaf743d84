"""A sharded run's output: one part per shard, and a manifest once every part is complete.

Shard ``I`` of ``N`` writes ``OUT``'s name with ``.part-IIIII-of-NNNNN`` before the extension
(``/d/emb.npy --shard 3/16`` makes ``/d/emb.part-00003-of-00016.npy``). A part is at that name only
once complete: an ``.npy`` or JSONL part grows under ``NAME.partial`` and is renamed when its shard
is done (Parquet stages its rows aside anyway and writes its file at the end). So whichever shard
finishes last sees every part at its name, and writes the manifest (``/d/emb.manifest.json``): the
parts in order with their row counts, read from the parts themselves. It is written aside and
renamed, and two shards that both finish last write the same file, so writing it is idempotent.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from kembed.client.corpus import FinalError
from kembed.client.corpus.reader import Shard
from kembed.client.corpus.writers import committed_shape


def part_path(output: Path, shard: Shard) -> Path:
    return output.with_name(f"{output.stem}.part-{shard.index:05d}-of-{shard.count:05d}{output.suffix}")


def growing_path(path: Path, output_format: str) -> Path:
    """Where a part of ``path`` grows until it is complete: beside it, unless it is already there
    (a complete part run again) or its writer stages its rows aside (Parquet)."""
    if output_format == "parquet" or path.exists():
        return path
    return path.with_name(path.name + ".partial")


def complete(growing: Path, path: Path) -> None:
    """The part is done: at its name, durably."""
    if growing != path:
        os.replace(growing, path)
        _sync_folder(path.parent)


def manifest_path(output: Path) -> Path:
    return output.with_name(f"{output.stem}.manifest.json")


def write_manifest(output: Path, count: int, output_format: str) -> Path | None:
    """The manifest of ``count`` parts of ``output``, if every part is complete; else None."""
    paths = [part_path(output, Shard(index, count)) for index in range(count)]
    if not all(path.exists() for path in paths):
        return None
    shapes = [committed_shape(path, output_format) for path in paths]
    widths = {dimensions for rows, dimensions in shapes if rows}
    if len(widths) > 1:
        raise FinalError(f"--output: the parts hold rows of {sorted(widths)} dimensions: no manifest written")
    manifest = {
        "format": output_format,
        "dimensions": widths.pop() if widths else None,
        "rows": sum(rows for rows, _ in shapes),
        "parts": [{"path": path.name, "rows": rows} for path, (rows, _) in zip(paths, shapes, strict=True)],
    }
    path = manifest_path(output)
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex}")  # shards finishing together each write their own
    with aside.open("w") as file:
        json.dump(manifest, file, indent=1)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(aside, path)
    _sync_folder(path.parent)
    return path


def _sync_folder(folder: Path) -> None:
    """A rename is durable once its folder is synced."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
