"""One corpus run: ask the server what it serves, open (or resume) the output, check the row it
ended on, stream the rest; for a shard, then complete its part and, if every part is, the manifest.

A resumed run checks the last row the output holds against what its input line says now, by
embedding the line again: an input that ended without a newline may have grown on that line
(``beta`` became ``beta gamma delta``), or the line was edited. A row that differs (cosine under
``SAME_ROW``) is replaced, with a note naming the line; the rows before it were complete lines
when they were written, so only an edit (not an append) can have changed them.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kembed.client.connection import Connection
from kembed.client.corpus import CorpusError, FinalError, file_error
from kembed.client.corpus.pacing import Pacing
from kembed.client.corpus.parts import complete, growing_path, part_path, write_manifest
from kembed.client.corpus.reader import CorpusReader, Limits, Shard, Span, ThreadedSpans
from kembed.client.corpus.stream import (
    RECONNECT,
    Counts,
    Progress,
    Request,
    Sink,
    StreamDriver,
    stream_seconds,
)
from kembed.client.corpus.writers import Writer, format_of, held_rows, open_writer
from kembed.client.requests import message_bytes
from kembed.client.window import Budget
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

INFO_TIMEOUT_S = 30.0
DEFAULT_JSONL_FIELD = "text"
# The same text embedded in another batch differs by float rounding (cosine 1 - 1e-7 in fp32, a
# little more in bf16); a line that changed by a word moves its row by far more.
SAME_ROW = 0.9999


@dataclass(frozen=True)
class CorpusRun:
    connection: Connection
    input: str  # a path, or "-" for stdin
    output: Path
    request: Request
    output_format: str | None = None  # None: from the output's extension
    jsonl_field: str | None = None  # None: plain lines, unless the input is named *.jsonl
    shard: Shard | None = None
    batch_texts: int = 32
    in_flight: int = 8
    give_up_after_s: float = 300.0
    progress: bool = True

    @property
    def part(self) -> Path:
        """What this run writes: the output, or its shard's part."""
        return self.output if self.shard is None else part_path(self.output, self.shard)


@dataclass
class Summary:
    """What a run did, filled in as it goes: read whatever way it ends."""

    output: Path
    shard: Shard | None
    rows: int = 0  # in the output (the part) now
    dimensions: int = 0
    skipped: int = 0  # rows the output held before this run, and kept
    blank: int = 0  # blank lines this run wrote, each as a row of zeros
    counts: Counts = field(default_factory=Counts)
    complete: bool = False  # every line embedded (for a shard: its part at its name)
    manifest: Path | None = None  # written by this run, as the last shard to finish
    seconds: float = 0.0
    error: str = ""  # why the run failed, if it did

    @property
    def embedded(self) -> int:
        return self.rows - self.skipped


class Interrupted(CorpusError):
    """^C or SIGTERM: what was written is committed, and the same command goes on from there."""


def embed_corpus(run: CorpusRun, summary: Summary) -> None:
    asyncio.run(_run(run, summary))


async def _run(run: CorpusRun, summary: Summary) -> None:
    main = asyncio.current_task()
    assert main is not None
    # Both handled here, not left to asyncio.run's ^C: a command started in the background from a
    # script inherits SIGINT ignored, and would then run on past a `kill -INT`.
    for stop in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(stop, main.cancel)
    started = time.monotonic()
    try:
        await _embed(run, summary)
    except asyncio.CancelledError:
        raise Interrupted("interrupted: the rows written are kept, and the same command goes on from them") from None
    finally:
        summary.seconds = time.monotonic() - started


async def _embed(run: CorpusRun, summary: Summary) -> None:
    output_format = format_of(run.output, run.output_format)
    field = run.jsonl_field or (DEFAULT_JSONL_FIELD if run.input.endswith(".jsonl") else None)
    growing = summary.output if run.shard is None else growing_path(summary.output, output_format)
    with output_errors(growing, summary):
        summary.rows = held_rows(growing, output_format)
    pacing = Pacing(run.give_up_after_s)
    async with run.connection.aio_channel() as channel:
        stub = pb_grpc.EmbedderStub(channel)
        info = await _info(stub, pacing, run.connection.target)
        dimensions = run.request.dimensions or info.dimensions
        if dimensions > info.dimensions:
            raise FinalError(f"--dimensions: {dimensions} exceeds the model's {info.dimensions}")
        reader = CorpusReader(run.input, field, _limits(run, info), run.shard)
        with output_errors(growing, summary):
            writer = open_writer(growing, output_format, dimensions)
            summary.rows = summary.skipped = writer.rows
            summary.dimensions = dimensions
            try:
                streams = Streams(stub, run, dimensions, pacing, summary.counts, info)
                await _embed_the_rest(streams, reader, writer, summary)
                writer.finish()
            finally:
                _commit_and_close(writer, summary)
    if run.shard is not None:
        with output_errors(summary.output, summary):
            complete(growing, summary.output)
            summary.manifest = write_manifest(run.output, run.shard.count, output_format)
    summary.complete = True


def _commit_and_close(writer: Writer, summary: Summary) -> None:
    """Interrupted or failed: every row written so far is kept, and counted in the summary; the
    file is closed even when committing fails (a full disk)."""
    try:
        writer.commit()
    finally:
        summary.rows = writer.rows
        writer.close()


@contextlib.contextmanager
def output_errors(path: Path, summary: Summary) -> Iterator[None]:
    """An OSError writing the output (its file, else ``path``) as one line that says what to do."""
    try:
        yield
    except OSError as error:
        raise file_error("--output", path, error, summary.rows) from None


@dataclass(frozen=True)
class Streams:
    """What a run's stream drivers share: the server, the requests' settings, the pacing, the counts."""

    stub: pb_grpc.EmbedderStub
    run: CorpusRun
    dimensions: int
    pacing: Pacing
    counts: Counts
    info: pb.InfoResponse  # the server's, as the run began

    def driver(self, sink: Sink, progress: Progress, texts: int, in_flight: int) -> StreamDriver:
        run, info = self.run, self.info
        budget = Budget(info, self.stub)
        return StreamDriver(
            self.stub,
            sink,
            run.request,
            self.dimensions,
            texts,
            in_flight,
            self.pacing,
            progress,
            budget,
            stream_seconds(info),
            self.counts,
        )


async def _embed_the_rest(streams: Streams, reader: CorpusReader, writer: Writer, summary: Summary) -> None:
    """Check the last row the output holds (if it holds any), then embed the lines after it."""
    run = streams.run
    spans = ThreadedSpans(reader.spans(run.batch_texts, writer.rows))
    if writer.rows:
        last = await spans.next()
        assert last is not None  # the last row's line comes first (or the error saying it is missing)
        notes = Bar(None, 0, enabled=False)
        probe = Probe(last.first)
        await streams.driver(probe, notes, 1, 1).run(ThreadedSpans(iter([last])))
        if keep_or_replace(writer, probe.kept[0], last, notes, summary):
            summary.blank += last.blank
    progress = Bar(reader.count() if run.progress else None, writer.rows, run.progress)
    driver = streams.driver(writer, progress, run.batch_texts, run.in_flight)
    try:
        await driver.run(spans)
    finally:
        summary.blank += driver.blank
        progress.close()


def _limits(run: CorpusRun, info: pb.InfoResponse) -> Limits:
    """What a request may carry: within the client's message limit and the server's (when it says)."""
    request = run.request
    return Limits(message_bytes(run.connection, info), info.max_text_chars, request.truncate, request.truncate_left)


def keep_or_replace(writer: Writer, row: np.ndarray, span: Span, progress: Progress, summary: Summary) -> bool:
    """The output's last row, embedded again from its line: replace the row if it is not that line's
    (whether it was)."""
    similarity = cosine(row, writer.last_row())
    if similarity >= SAME_ROW:
        return False
    progress.note(f"{span.line(0)} changed since its row was written (cosine {similarity:.4f}): its row is replaced")
    writer.drop_last()
    writer.append(row[np.newaxis])
    writer.commit()
    summary.skipped -= 1
    return True


class Probe:
    """Where the check's driver puts its row: kept, not written."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.kept: list[np.ndarray] = []

    def append(self, vectors: np.ndarray) -> None:
        self.kept.extend(vectors)

    def commit(self) -> None:
        pass


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b)) / norms if norms else float(np.array_equal(a, b))


async def _info(stub: pb_grpc.EmbedderStub, pacing: Pacing, target: str) -> pb.InfoResponse:
    """What the server serves, waiting out a server that is warming up (within --give-up-after)."""
    while True:
        try:
            info: pb.InfoResponse = await stub.Info(pb.InfoRequest(), timeout=INFO_TIMEOUT_S)
            return info
        except grpc.aio.AioRpcError as error:
            why = f"{error.code().name}: {error.details()}"
            if error.code() not in RECONNECT:
                raise CorpusError(f"--target {target}: {why}") from None
            pacing.failed(why)
            # UNAVAILABLE is also how a TLS mismatch looks: say so, not only after --give-up-after.
            print(f"--target {target}: {why}; trying again in {pacing.wait_s():.1f} s", file=sys.stderr)
            await asyncio.sleep(pacing.wait_s())


class Bar:
    """Progress on stderr: a tqdm bar with texts/s when tqdm is installed and wanted; else only
    the notes (reconnects)."""

    def __init__(self, total: int | None, done: int, enabled: bool) -> None:
        self._bar = _tqdm(total, done) if enabled else None

    def update(self, rows: int) -> None:
        if self._bar is not None:
            self._bar.update(rows)

    def note(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _tqdm(total: int | None, done: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=done, unit=" texts", dynamic_ncols=True, file=sys.stderr)
