"""One corpus run: ask the server what it serves, open (or resume) the output, stream the rest."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kembed.client.connection import Connection
from kembed.client.corpus import CorpusError
from kembed.client.corpus.reader import ThreadedSpans, count_lines, spans, texts
from kembed.client.corpus.stream import RECONNECT, Counts, Pacing, Request, StreamDriver
from kembed.client.corpus.writers import format_of, open_writer
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

INFO_TIMEOUT_S = 30.0
DEFAULT_JSONL_FIELD = "text"


@dataclass(frozen=True)
class CorpusRun:
    connection: Connection
    input: str  # a path, or "-" for stdin
    output: Path
    output_format: str | None = None  # None: from the output's extension
    jsonl_field: str | None = None  # None: plain lines, unless the input is named *.jsonl
    batch_texts: int = 32
    in_flight: int = 8
    dimensions: int = 0
    truncate: bool = True
    priority: str = "batch"  # or "interactive": the requests' class
    give_up_after_s: float = 300.0
    progress: bool = True


@dataclass(frozen=True)
class Summary:
    rows: int  # in the output now
    dimensions: int
    skipped: int  # rows the output held before this run
    counts: Counts
    seconds: float


class Interrupted(CorpusError):
    """^C or SIGTERM: what was written is committed, and the same command goes on from there."""


def embed_corpus(run: CorpusRun) -> Summary:
    return asyncio.run(_run(run))


async def _run(run: CorpusRun) -> Summary:
    main = asyncio.current_task()
    assert main is not None
    # Both handled here, not left to asyncio.run's ^C: a command started in the background from a
    # script inherits SIGINT ignored, and would then run on past a `kill -INT`.
    for stop in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(stop, main.cancel)
    try:
        return await _embed(run)
    except asyncio.CancelledError:
        raise Interrupted(f"interrupted: {run.output} keeps the rows written; the same command goes on") from None


async def _embed(run: CorpusRun) -> Summary:
    started = time.monotonic()
    output_format = format_of(run.output, run.output_format)
    field = run.jsonl_field or (DEFAULT_JSONL_FIELD if run.input.endswith(".jsonl") else None)
    total = count_lines(run.input)
    pacing = Pacing(run.give_up_after_s)
    async with run.connection.aio_channel() as channel:
        stub = pb_grpc.EmbedderStub(channel)
        info = await _info(stub, pacing, run.connection.target)
        dimensions = run.dimensions or info.dimensions
        if dimensions > info.dimensions:
            raise CorpusError(f"--dimensions: {dimensions} exceeds the model's {info.dimensions}")
        writer = open_writer(run.output, output_format, dimensions)
        skipped = writer.rows
        progress = Bar(total, skipped, run.progress)
        try:
            request = Request(run.dimensions, run.truncate, run.priority)
            driver = StreamDriver(stub, writer, request, dimensions, run.batch_texts, run.in_flight, pacing, progress)
            counts = await driver.run(ThreadedSpans(spans(texts(run.input, field), run.batch_texts, skipped)))
            writer.finish()
        finally:
            writer.commit()  # interrupted or failed: every row written so far is kept
            writer.close()
            progress.close()
    return Summary(writer.rows, dimensions, skipped, counts, time.monotonic() - started)


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
