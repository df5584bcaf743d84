"""Rows out, in input order, resumable: each writer opens an output that may already hold rows.

A writer's ``rows`` are the rows its output holds, committed: on disk (fsynced) and counted where
a reopened output reads its count. ``append`` writes rows after them (flushed to the OS, so a
killed process loses nothing the kernel has); ``commit`` makes them durable and counted; ``finish``
also finalises the output (Parquet is written then). Reopening drops what was appended but not
committed, so a crash mid-write (a torn row, a header not yet updated) costs a re-embed of at most
the rows since the last commit, never a corrupt output. ``last_row`` reads the last committed row
back and ``drop_last`` uncommits it, so that a resumed run can check it against its input line and
replace it (:mod:`kembed.client.corpus.run`).

- ``.npy``: float32 ``[rows, dimensions]``. Rows go after the header, whose shape is rewritten in
  place at each commit (numpy pads its headers so the first axis can grow), after an fsync of the
  rows: the header is the commit record, and the file is a valid array of the committed rows at
  every moment.
- JSONL: one ``{"index": i, "embedding": [...]}`` line per row; a complete line is a committed row
  (a torn last line is dropped), and the last complete line's index counts them, read from the
  end of the file. Values are written with 9 significant digits, which read back as exactly the
  float32 the server sent.
- Parquet (needs pyarrow): one column ``embedding``, ``fixed_size_list<float32>[dimensions]``. A
  Parquet file cannot grow, so rows go to a staging ``.npy`` beside it
  (``OUT.parquet.partial.npy``), and ``finish`` writes the Parquet file from it (written aside,
  then renamed) and removes it. Appending to a finished Parquet file rewrites it.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from kembed.client.corpus import CorpusError, FinalError

FORMATS = ("npy", "jsonl", "parquet")
PARQUET_ROW_GROUP = 65_536
PARQUET_COLUMN = "embedding"
# Room in a reopened .npy header for the count to grow: checked when opening, not mid-run.
LARGEST_COUNT = 10**15
BACKWARDS_BLOCK = 65_536  # read at a time when looking for a JSONL output's last line
MAX_JSONL_ROW_BYTES = 16 * 1024 * 1024  # a row of 4,096 dimensions is about 64 KiB


class Writer(Protocol):
    rows: int

    def append(self, vectors: np.ndarray) -> None: ...

    def commit(self) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...

    def last_row(self) -> np.ndarray:
        """The last committed row (there is one)."""
        ...

    def drop_last(self) -> None:
        """Uncommit the last row, durably, so the next one appended takes its place (nothing pending)."""
        ...


def format_of(path: Path, named: str | None) -> str:
    """The output format: ``named`` (``--format``), else from the file's extension; checked before
    the run connects, with what writing it needs (pyarrow for Parquet)."""
    output_format = named if named is not None else path.suffix.lstrip(".").lower()
    if output_format not in FORMATS:
        raise FinalError(
            f"--output: no format named by {path.name!r}: end it in .npy, .jsonl or .parquet, or use --format"
        )
    if output_format == "parquet":
        _pyarrow()
    return output_format


def open_writer(path: Path, output_format: str, dimensions: int) -> Writer:
    """A writer for ``path``, resuming after the rows it already holds."""
    if output_format == "npy":
        return NpyWriter(path, dimensions)
    if output_format == "jsonl":
        return JsonlWriter(path, dimensions)
    return ParquetWriter(path, dimensions)


def committed_shape(path: Path, output_format: str) -> tuple[int, int]:
    """Rows and dimensions an output holds, read without changing it (its header, last line or
    metadata): a finished part, for the manifest."""
    if output_format == "npy":
        with path.open("rb") as file:
            rows, dimensions = _npy_shape(file, path)
        return rows, dimensions
    if output_format == "jsonl":
        with path.open("rb") as file:
            rows, dimensions, _ = _jsonl_tail(file, path)
        return rows, dimensions
    parquet = _parquet_file(path)
    return int(parquet.metadata.num_rows), int(parquet.schema_arrow.field(PARQUET_COLUMN).type.list_size)


def held_rows(path: Path, output_format: str) -> int:
    """The rows an output holds (0 if it is not there yet), read without changing it."""
    staging = _staging_path(path)
    if output_format == "parquet" and staging.exists():
        return committed_shape(staging, "npy")[0]
    return committed_shape(path, output_format)[0] if path.exists() else 0


def _open_alone(path: Path) -> BinaryIO:
    """The output, open for appending, and locked: two runs writing one output (a shard run twice
    at once) would interleave their rows."""
    file = path.open("r+b" if path.exists() else "w+b")
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        raise CorpusError(f"--output: another run is writing {path}") from None
    return file


def _sync(file: BinaryIO) -> None:
    file.flush()
    os.fsync(file.fileno())


def _npy_shape(file: BinaryIO, path: Path) -> tuple[int, int]:
    """A float32 ``[rows, dimensions]`` .npy header's shape; the file is left after the header."""
    try:
        version = np.lib.format.read_magic(file)
        if version != (1, 0):
            raise ValueError(f"version {version[0]}.{version[1]}, not 1.0")
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(file)
    except ValueError as error:
        raise FinalError(f"--output: {path} is not a .npy file kembed can append to: {error}") from None
    if dtype != np.dtype("<f4") or fortran_order or len(shape) != 2:
        raise FinalError(f"--output: {path} holds {dtype} {shape}, not float32 rows: use a new output")
    return int(shape[0]), int(shape[1])


class _AppendedFile:
    """An output that is final once committed: one file, appended to."""

    _file: BinaryIO

    def commit(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        self.commit()

    def close(self) -> None:
        self._file.close()


class NpyWriter(_AppendedFile):
    def __init__(self, path: Path, dimensions: int) -> None:
        self._path = path
        self._dimensions = dimensions
        self._row_bytes = dimensions * 4
        self._pending = 0
        self._offset = 0  # where the rows start, after the header
        exists = path.exists() and path.stat().st_size > 0
        self._file = _open_alone(path)
        try:
            self.rows = self._reopen() if exists else self._create()
        except BaseException:
            self._file.close()
            raise
        # A torn or uncommitted tail is dropped: appends go right after the committed rows.
        self._file.truncate(self._offset + self.rows * self._row_bytes)
        self._file.seek(0, io.SEEK_END)

    def _create(self) -> int:
        self._file.write(self._header(0))
        self._offset = self._file.tell()
        _sync(self._file)
        return 0

    def _reopen(self) -> int:
        rows, dimensions = _npy_shape(self._file, self._path)
        self._offset = self._file.tell()
        if dimensions != self._dimensions:
            raise FinalError(
                f"--output: {self._path} holds {dimensions}-dimensional rows, this run makes {self._dimensions} "
                "(--dimensions, or another model): use a new output"
            )
        if len(self._header(LARGEST_COUNT)) != self._offset:
            raise FinalError(f"--output: {self._path}'s header has no room to grow: use a new output")
        held = (self._file.seek(0, io.SEEK_END) - self._offset) // self._row_bytes
        if held < rows:
            raise FinalError(f"--output: {self._path} is shorter than its header says ({held} of {rows} rows)")
        return rows

    def _header(self, rows: int) -> bytes:
        header = io.BytesIO()
        description = {"descr": "<f4", "fortran_order": False, "shape": (rows, self._dimensions)}
        np.lib.format.write_array_header_1_0(header, description)
        return header.getvalue()

    def append(self, vectors: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(vectors, dtype="<f4").tobytes())
        self._file.flush()
        self._pending += len(vectors)

    def commit(self) -> None:
        if not self._pending:
            return
        _sync(self._file)  # the rows first: the header must never count rows not on disk
        self._count(self.rows + self._pending)
        self._pending = 0

    def _count(self, rows: int) -> None:
        """Rewrite the header's count, durably."""
        self.rows = rows
        end = self._file.tell()
        self._file.seek(0)
        self._file.write(self._header(rows))
        _sync(self._file)
        self._file.seek(end)

    def last_row(self) -> np.ndarray:
        start = self._offset + (self.rows - 1) * self._row_bytes
        return np.frombuffer(os.pread(self._file.fileno(), self._row_bytes, start), dtype="<f4")

    def drop_last(self) -> None:
        self._count(self.rows - 1)  # the header first: it must never count a row that is gone
        self._file.truncate(self._offset + self.rows * self._row_bytes)
        self._file.seek(0, io.SEEK_END)


class JsonlWriter(_AppendedFile):
    def __init__(self, path: Path, dimensions: int) -> None:
        self._path = path
        self._dimensions = dimensions
        self._pending = 0
        self._file = _open_alone(path)
        try:
            self.rows, width, end = _jsonl_tail(self._file, path)
        except BaseException:
            self._file.close()
            raise
        if self.rows and width != dimensions:
            self._file.close()
            raise FinalError(
                f"--output: {path} holds {width}-dimensional rows, this run makes {dimensions} "
                "(--dimensions, or another model): use a new output"
            )
        self._file.truncate(end)  # a torn last line goes
        self._file.seek(end)

    def append(self, vectors: np.ndarray) -> None:
        first = self.rows + self._pending
        lines = [
            f'{{"index": {first + i}, "embedding": [{",".join(map("{:.9g}".format, row))}]}}\n'
            for i, row in enumerate(vectors.tolist())
        ]
        self._file.write("".join(lines).encode())
        self._file.flush()
        self._pending += len(vectors)

    def commit(self) -> None:
        if self._pending:
            _sync(self._file)
            self.rows += self._pending
            self._pending = 0

    def last_row(self) -> np.ndarray:
        end = self._file.tell()
        start = _after_last_newline(self._file, end - 1)
        return np.asarray(json.loads(os.pread(self._file.fileno(), end - start, start))["embedding"], dtype=np.float32)

    def drop_last(self) -> None:
        self._file.truncate(_after_last_newline(self._file, self._file.tell() - 1))
        _sync(self._file)
        self._file.seek(0, io.SEEK_END)
        self.rows -= 1


def _jsonl_tail(file: BinaryIO, path: Path) -> tuple[int, int, int]:
    """Rows, dimensions and where the complete lines end, read from both ends of the file: the
    first row must be index 0, the last complete line's index counts the rows."""
    end = _after_last_newline(file, file.seek(0, io.SEEK_END))  # a torn tail is not a row
    if end == 0:
        return 0, 0, 0
    file.seek(0)
    first, _ = _row_of(file.readline(MAX_JSONL_ROW_BYTES), path, 1)
    if first != 0:
        raise FinalError(f"--output: {path} starts at index {first}: not a file kembed wrote")
    start = _after_last_newline(file, end - 1)
    index, width = _row_of(os.pread(file.fileno(), end - start, start), path, None)
    return index + 1, width, end


def _row_of(line: bytes, path: Path, number: int | None) -> tuple[int, int]:
    """A JSONL row's index and width."""
    try:
        record = json.loads(line)
        index, width = record["index"], len(record["embedding"])
    except (ValueError, KeyError, TypeError):
        where = f"line {number}" if number else "the last line"
        raise FinalError(f"--output: {where} of {path} is not a row kembed writes") from None
    if not isinstance(index, int) or index < 0:
        raise FinalError(f"--output: {path} holds index {index!r}: not a file kembed wrote")
    return index, width


def _after_last_newline(file: BinaryIO, end: int) -> int:
    """Just after the last newline in the file's first ``end`` bytes (0 without one), read
    backwards in blocks: where the line holding byte ``end`` starts."""
    position = end
    while position > 0:
        block = os.pread(file.fileno(), min(BACKWARDS_BLOCK, position), max(0, position - BACKWARDS_BLOCK))
        found = block.rfind(b"\n")
        if found >= 0:
            return position - len(block) + found + 1
        position -= len(block)
    return 0


class ParquetWriter:
    def __init__(self, path: Path, dimensions: int) -> None:
        self._pa, self._pq = _pyarrow()
        self._path = path
        self._dimensions = dimensions
        self._staging_path = _staging_path(path)
        self._staging: NpyWriter | None = None
        if self._staging_path.exists():  # an interrupted run: the staging rows are the newest
            self._staging = NpyWriter(self._staging_path, dimensions)
            self.rows = self._staging.rows
        else:
            self.rows = self._finished_rows()

    def _finished_rows(self) -> int:
        if not self._path.exists():
            return 0
        finished = _parquet_file(self._path)
        column = finished.schema_arrow.field(PARQUET_COLUMN).type
        if column != self._column_type():
            raise FinalError(f"--output: {self._path}'s {PARQUET_COLUMN} is {column}, not {self._column_type()}")
        return int(finished.metadata.num_rows)

    def _column_type(self) -> Any:
        return self._pa.list_(self._pa.float32(), self._dimensions)

    def append(self, vectors: np.ndarray) -> None:
        if self._staging is None:
            self._staging = self._stage_finished_rows()
        self._staging.append(vectors)

    def _stage_finished_rows(self) -> NpyWriter:
        """A staging file holding the finished Parquet file's rows, to go on from. Filled aside
        and renamed: a staging file, once there, holds every row the Parquet file had."""
        if self.rows:
            seeding = self._staging_path.with_name(self._staging_path.name + ".seeding")
            seeding.unlink(missing_ok=True)  # left by a run stopped while seeding
            seeded = NpyWriter(seeding, self._dimensions)
            for batch in _parquet_file(self._path).iter_batches(columns=[PARQUET_COLUMN]):
                seeded.append(batch.column(0).flatten().to_numpy().reshape(-1, self._dimensions))
            seeded.finish()
            seeded.close()
            os.replace(seeding, self._staging_path)
        return NpyWriter(self._staging_path, self._dimensions)

    def commit(self) -> None:
        if self._staging is not None:
            self._staging.commit()
            self.rows = self._staging.rows

    def last_row(self) -> np.ndarray:
        if self._staging is not None:
            return self._staging.last_row()
        finished = _parquet_file(self._path)
        group = finished.read_row_group(finished.num_row_groups - 1, columns=[PARQUET_COLUMN])
        return np.asarray(group.column(0)[-1].values.to_numpy(), dtype=np.float32)

    def drop_last(self) -> None:
        if self._staging is None:
            self._staging = self._stage_finished_rows()
        self._staging.drop_last()
        self.rows = self._staging.rows

    def finish(self) -> None:
        if self._staging is None and self._path.exists():
            return  # nothing appended to a finished file
        self.commit()
        rows = np.load(self._staging_path, mmap_mode="r") if self._staging else np.zeros((0, self._dimensions), "<f4")
        schema = self._pa.schema([(PARQUET_COLUMN, self._column_type())])
        aside = self._path.with_name(self._path.name + ".writing")
        with self._pq.ParquetWriter(aside, schema) as parquet:
            for start in range(0, max(len(rows), 1), PARQUET_ROW_GROUP):
                flat = self._pa.array(np.ascontiguousarray(rows[start : start + PARQUET_ROW_GROUP]).reshape(-1))
                column = self._pa.FixedSizeListArray.from_arrays(flat, self._dimensions)
                parquet.write_table(self._pa.table({PARQUET_COLUMN: column}, schema=schema))
        with aside.open("rb") as written:
            os.fsync(written.fileno())
        os.replace(aside, self._path)
        if self._staging is not None:
            self._staging.close()
            self._staging_path.unlink()
            self._staging = None

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()


def _staging_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial.npy")


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise FinalError("--output: Parquet needs pyarrow (pip install pyarrow)") from None
    return pa, pq


def _parquet_file(path: Path) -> Any:
    pa, pq = _pyarrow()
    try:
        file = pq.ParquetFile(path)
        file.schema_arrow.field(PARQUET_COLUMN)
    except (OSError, KeyError, pa.ArrowException) as error:
        raise FinalError(f"--output: {path} is not a Parquet file of embeddings: {error}") from None
    return file
