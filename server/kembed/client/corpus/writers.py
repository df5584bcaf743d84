"""Rows out, in input order, resumable: each writer opens an output that may already hold rows.

A writer's ``rows`` are the rows its output holds, committed: on disk (fsynced) and counted where
a reopened output reads its count. ``append`` writes rows after them (flushed to the OS, so a
killed process loses nothing the kernel has); ``commit`` makes them durable and counted; ``finish``
also finalises the output (Parquet is written then). Reopening drops what was appended but not
committed, so a crash mid-write (a torn row, a header not yet updated) costs a re-embed of at most
the rows since the last commit, never a corrupt output.

- ``.npy``: float32 ``[rows, dimensions]``. Rows go after the header, whose shape is rewritten in
  place at each commit (numpy pads its headers so the first axis can grow), after an fsync of the
  rows: the header is the commit record, and the file is a valid array of the committed rows at
  every moment.
- JSONL: one ``{"index": i, "embedding": [...]}`` line per row; a complete line is a committed row
  (a torn last line is dropped). Values are written with 9 significant digits, which read back
  as exactly the float32 the server sent.
- Parquet (needs pyarrow): one column ``embedding``, ``fixed_size_list<float32>[dimensions]``. A
  Parquet file cannot grow, so rows go to a staging ``.npy`` beside it
  (``OUT.parquet.partial.npy``), and ``finish`` writes the Parquet file from it (written aside,
  then renamed) and removes it. Appending to a finished Parquet file rewrites it.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from kembed.client.corpus import CorpusError

FORMATS = ("npy", "jsonl", "parquet")
PARQUET_ROW_GROUP = 65_536
PARQUET_COLUMN = "embedding"
# Room in a reopened .npy header for the count to grow: checked when opening, not mid-run.
LARGEST_COUNT = 10**15


class Writer(Protocol):
    rows: int

    def append(self, vectors: np.ndarray) -> None: ...

    def commit(self) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


def format_of(path: Path, named: str | None) -> str:
    """The output format: ``named`` (``--format``), else from the file's extension."""
    if named is not None:
        return named
    suffix = path.suffix.lstrip(".").lower()
    if suffix in FORMATS:
        return suffix
    raise CorpusError(
        f"--output: no format named by {path.name!r}: end it in .npy, .jsonl or .parquet, or use --format"
    )


def open_writer(path: Path, output_format: str, dimensions: int) -> Writer:
    """A writer for ``path``, resuming after the rows it already holds."""
    if output_format == "npy":
        return NpyWriter(path, dimensions)
    if output_format == "jsonl":
        return JsonlWriter(path, dimensions)
    return ParquetWriter(path, dimensions)


def _sync(file: BinaryIO) -> None:
    file.flush()
    os.fsync(file.fileno())


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
        self._file = path.open("r+b" if exists else "w+b")
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
        try:
            version = np.lib.format.read_magic(self._file)
            if version != (1, 0):
                raise ValueError(f"version {version[0]}.{version[1]}, not 1.0")
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(self._file)
        except ValueError as error:
            raise CorpusError(f"--output: {self._path} is not a .npy file kembed can append to: {error}") from None
        self._offset = self._file.tell()
        if dtype != np.dtype("<f4") or fortran_order or len(shape) != 2:
            raise CorpusError(f"--output: {self._path} holds {dtype} {shape}, not float32 rows: use a new output")
        if shape[1] != self._dimensions:
            raise CorpusError(
                f"--output: {self._path} holds {shape[1]}-dimensional rows, this run makes {self._dimensions} "
                "(--dimensions, or another model): use a new output"
            )
        if len(self._header(LARGEST_COUNT)) != self._offset:
            raise CorpusError(f"--output: {self._path}'s header has no room to grow: use a new output")
        held = (self._file.seek(0, io.SEEK_END) - self._offset) // self._row_bytes
        if held < shape[0]:
            raise CorpusError(f"--output: {self._path} is shorter than its header says ({held} of {shape[0]} rows)")
        return int(shape[0])

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
        self.rows += self._pending
        self._pending = 0
        end = self._file.tell()
        self._file.seek(0)
        self._file.write(self._header(self.rows))
        _sync(self._file)
        self._file.seek(end)


class JsonlWriter(_AppendedFile):
    def __init__(self, path: Path, dimensions: int) -> None:
        self._path = path
        self._dimensions = dimensions
        self._pending = 0
        self.rows, end = self._committed() if path.exists() else (0, 0)
        self._file = path.open("r+b" if path.exists() else "w+b")
        self._file.truncate(end)  # a torn last line goes
        self._file.seek(end)

    def _committed(self) -> tuple[int, int]:
        """The complete lines and where they end; the last one must be this run's kind of row."""
        rows, end, last = 0, 0, b""
        with self._path.open("rb") as file:
            for line in file:
                if not line.endswith(b"\n"):
                    break
                rows, end, last = rows + 1, end + len(line), line
        if rows:
            self._check_row(last, rows)
        return rows, end

    def _check_row(self, line: bytes, rows: int) -> None:
        try:
            record = json.loads(line)
            index, width = record["index"], len(record["embedding"])
        except (ValueError, KeyError, TypeError):
            raise CorpusError(f"--output: line {rows} of {self._path} is not a row kembed writes") from None
        if index != rows - 1:
            raise CorpusError(f"--output: line {rows} of {self._path} has index {index}: not a file kembed wrote")
        if width != self._dimensions:
            raise CorpusError(
                f"--output: {self._path} holds {width}-dimensional rows, this run makes {self._dimensions} "
                "(--dimensions, or another model): use a new output"
            )

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


class ParquetWriter:
    def __init__(self, path: Path, dimensions: int) -> None:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise CorpusError("--output: Parquet needs pyarrow (pip install pyarrow)") from None
        self._pa, self._pq = pa, pq
        self._path = path
        self._dimensions = dimensions
        self._staging_path = path.with_name(path.name + ".partial.npy")
        self._staging: NpyWriter | None = None
        if self._staging_path.exists():  # an interrupted run: the staging rows are the newest
            self._staging = NpyWriter(self._staging_path, dimensions)
            self.rows = self._staging.rows
        else:
            self.rows = self._finished_rows()

    def _finished_rows(self) -> int:
        if not self._path.exists():
            return 0
        finished = self._existing_file()
        column = finished.schema_arrow.field(PARQUET_COLUMN).type
        if column != self._column_type():
            raise CorpusError(f"--output: {self._path}'s {PARQUET_COLUMN} is {column}, not {self._column_type()}")
        return int(finished.metadata.num_rows)

    def _existing_file(self) -> Any:
        try:
            file = self._pq.ParquetFile(self._path)
            file.schema_arrow.field(PARQUET_COLUMN)
        except (OSError, KeyError, self._pa.ArrowException) as error:
            raise CorpusError(f"--output: {self._path} is not a Parquet file of embeddings: {error}") from None
        return file

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
            for batch in self._existing_file().iter_batches(columns=[PARQUET_COLUMN]):
                seeded.append(batch.column(0).flatten().to_numpy().reshape(-1, self._dimensions))
            seeded.finish()
            seeded.close()
            os.replace(seeding, self._staging_path)
        return NpyWriter(self._staging_path, self._dimensions)

    def commit(self) -> None:
        if self._staging is not None:
            self._staging.commit()
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
