"""Texts in: one per line, or one JSON object per line with the text in a field; cut into spans.

Line ``n`` (1-based) of the input is row ``n - 1`` of the output. Lines end at ``\\n`` (a ``\\r``
before it is dropped, so CRLF files read as expected); an empty line is an empty text. Input is
UTF-8, strictly: a bad byte or a JSON line without the field is an error naming the line.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from kembed.client.corpus import CorpusError

STDIN = "-"


@dataclass(frozen=True)
class Span:
    """Consecutive texts of the input; ``first`` is the row of ``texts[0]``."""

    first: int
    texts: list[str]

    def split(self, texts: int) -> tuple[Span, Span]:
        """The first ``texts`` texts, and the rest."""
        return Span(self.first, self.texts[:texts]), Span(self.first + texts, self.texts[texts:])

    @property
    def lines(self) -> str:
        """The input lines it came from (1-based), for messages."""
        return f"input lines {self.first + 1}-{self.first + len(self.texts)}"


def open_input(source: str) -> BinaryIO:
    """The file ``source``, or stdin for ``-``, as bytes: each line is decoded on its own, so a
    decoding error names its line."""
    if source == STDIN:
        # A reader of its own on fd 0, not sys.stdin's: the input thread may be blocked in a read
        # when an interrupted run exits, and the interpreter then takes sys.stdin's lock.
        return open(sys.stdin.fileno(), "rb", closefd=False)
    try:
        return open(source, "rb")
    except OSError as error:
        raise CorpusError(f"--input: {error}") from None


def count_lines(source: str) -> int | None:
    """How many texts the file holds (for the progress bar), without decoding; None for stdin."""
    if source == STDIN:
        return None
    count, last = 0, b"\n"
    with open_input(source) as file:
        while chunk := file.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def texts(source: str, jsonl_field: str | None) -> Iterator[str]:
    """The texts of ``source``, read as they are needed; the file is closed at its end."""
    with open_input(source) as lines:
        yield from read_texts(lines, jsonl_field)


def read_texts(lines: Iterable[bytes], jsonl_field: str | None) -> Iterator[str]:
    """Each line's text: the line itself, or with ``jsonl_field`` that field of the line's JSON object."""
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.removesuffix(b"\n").removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError as error:
            raise CorpusError(f"input line {number}: not UTF-8 (byte {error.start + 1}: {error.reason})") from None
        yield line if jsonl_field is None else field_of(line, jsonl_field, number)


def field_of(line: str, field: str, number: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise CorpusError(f"input line {number}: not a JSON object ({error.msg})") from None
    if not isinstance(record, dict) or field not in record:
        raise CorpusError(f"input line {number}: no field {field!r}")
    text = record[field]
    if not isinstance(text, str):
        raise CorpusError(f"input line {number}: field {field!r} is not a string: {json.dumps(text)[:40]}")
    try:
        text.encode("utf-8")  # JSON escapes can spell a lone surrogate, which no request can carry
    except UnicodeEncodeError:
        raise CorpusError(f"input line {number}: field {field!r} holds a lone surrogate, not text") from None
    return text


def spans(texts: Iterator[str], size: int, skip: int) -> Iterator[Span]:
    """Batches of ``size`` texts, after the first ``skip`` (the rows the output already holds); at a
    bad line, the texts before it, then its error."""
    skipped = sum(1 for _ in itertools.islice(texts, skip))
    if skipped < skip:
        raise CorpusError(
            f"--output already holds {skip} rows but the input has only {skipped} texts: "
            "a resumed run needs the same input (or one that extends it)"
        )
    first, chunk = skip, []
    try:
        for text in texts:
            chunk.append(text)
            if len(chunk) == size:
                yield Span(first, chunk)
                first, chunk = first + size, []
    except CorpusError:
        if chunk:  # the texts before a bad line are embedded too, so a re-run starts at that line
            yield Span(first, chunk)
        raise
    if chunk:
        yield Span(first, chunk)


class ThreadedSpans:
    """Batches from a blocking iterator, read in a daemon thread a span ahead: a pipe that stalls
    holds up only new requests, never the answers being written; and an interrupted run does not
    wait for a read that may never return."""

    def __init__(self, source: Iterator[Span]) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Queue[Span | Exception | None] = asyncio.Queue()
        self._taken = threading.Semaphore(0)
        threading.Thread(target=self._pump, args=(source,), name="kembed-input", daemon=True).start()

    async def next(self) -> Span | None:
        """The next span, or None at the end of the input."""
        item = await self._ready.get()
        self._taken.release()
        if isinstance(item, Exception):
            raise item
        return item

    def _pump(self, source: Iterator[Span]) -> None:
        try:
            for span in source:
                self._hand_over(span)
        except Exception as error:  # raised where it is awaited: a thread's own would go unseen
            self._hand_over(error)
        else:
            self._hand_over(None)

    def _hand_over(self, item: Span | Exception | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the run is over, nobody reads on
            self._loop.call_soon_threadsafe(self._ready.put_nowait, item)
        if item is not None:
            self._taken.acquire()  # one span handed over, not yet taken, while the next is read
