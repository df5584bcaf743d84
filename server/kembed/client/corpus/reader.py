"""The corpus reader: texts in, one per line or one JSON object per line with the text in a field,
cut into spans of consecutive texts that each fit in one request.

Line ``n`` (1-based) of the input, or of a shard, is row ``n - 1`` of the output, or of the part.
Lines end at ``\\n`` (a ``\\r`` before it is dropped, so CRLF files read as expected); an empty
line, or one without content (only whitespace or invisible characters: ``kembed/domain/texts.py``, the
server's rule), is not sent, and its row is zeros (:attr:`Span.sent`: the server refuses such a text).
Input is UTF-8, strictly: a bad byte or a JSON line without the field is an error naming the line.
So is a ``\\r`` anywhere else in a line: a file with CR-only line ends
(old Mac) would otherwise be one text, and splitting there instead would make the rows disagree
with the line numbers every other tool counts (``wc -l``).

A shard ``I/N`` of a file is its byte range ``[I * size // N, (I + 1) * size // N)`` aligned to line
starts, as Hadoop splits text: it holds every line that *starts* in its range, so it reads at most
one line past its end, and its first line is the first that starts at or after its start (the one
before belongs to the shard before). The shards' lines, in shard order, are the file's.

Memory is bounded whatever the input: a line is read at most ``Limits.line_bytes`` at a time. A
text longer than a request may carry is cut (``truncate``) or refused, naming its line; with
``truncate`` a text is also cut to the server's character limit, since the server would cut it.
Cutting keeps a text's start, or truncating left its end (``Limits.truncate_left``: a line too long
to read whole is then read to its end, only its last ``line_bytes`` held).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from kembed.client.corpus import FinalError, file_error
from kembed.client.requests import REQUEST_ENVELOPE_BYTES, TEXT_ENVELOPE_BYTES, cut_chars, split_texts
from kembed.domain.texts import has_content

STDIN = "-"
# A JSONL line may hold this many times what its text may (escapes, other fields); past that it
# cannot be parsed without holding it all, and is refused.
JSONL_LINE_FACTOR = 4
SKIP_CHUNK = 1 << 20  # read at a time while skipping the rest of an over-long line


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (``--shard I/N``, ``0 <= I < N``)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, slash, count = text.partition("/")
        if not (slash and index.isdigit() and count.isdigit()):
            raise ValueError(f"{text!r} is not I/N")
        shard = cls(int(index), int(count))
        if not 0 <= shard.index < shard.count <= 99_999:
            raise ValueError(f"{text!r}: I must be in [0, N), and N at most 99999")
        return shard

    def byte_range(self, size: int) -> tuple[int, int]:
        return self.index * size // self.count, (self.index + 1) * size // self.count

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class Limits:
    """How large a text may be: what one request carries, and the server's character limit."""

    message_bytes: int  # the smaller of the server's and the client's message limits
    text_chars: int = 0  # 0: the server did not say
    truncate: bool = True
    truncate_left: bool = False  # with truncate: a text is cut to its end, as the server cuts it

    @property
    def request_bytes(self) -> int:
        """What the texts of one request may weigh, their envelopes included."""
        return self.message_bytes - REQUEST_ENVELOPE_BYTES

    @property
    def text_bytes(self) -> int:
        """The most a text may weigh, alone in its request."""
        return self.request_bytes - TEXT_ENVELOPE_BYTES

    def line_bytes(self, jsonl: bool) -> int:
        return self.text_bytes * JSONL_LINE_FACTOR if jsonl else self.text_bytes


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, in the input or the shard
    offset: int  # of its first byte, in the input
    data: bytes  # without its line end; cut to the limit it was read with
    cut: bool  # longer than that limit


@dataclass(frozen=True)
class Span:
    """Consecutive texts of the input; ``first`` is the row of ``texts[0]``."""

    first: int
    texts: list[str]
    shard: Shard | None = None  # for messages: rows count from the shard's first line

    def split(self, texts: int) -> tuple[Span, Span]:
        """The first ``texts`` texts, and the rest."""
        return (
            Span(self.first, self.texts[:texts], self.shard),
            Span(self.first + texts, self.texts[texts:], self.shard),
        )

    @property
    def sent(self) -> list[str]:
        """The texts a request carries: all but the blank ones (empty, or without content), whose
        rows are zeros (the server refuses them)."""
        return [text for text in self.texts if has_content(text)]

    @property
    def blank(self) -> int:
        return len(self.texts) - len(self.sent)

    def rows(self, vectors: np.ndarray) -> np.ndarray:
        """The span's rows from the vectors of its sent texts: a row of zeros at each blank line."""
        if len(vectors) == len(self.texts):
            return vectors
        rows = np.zeros((len(self.texts), vectors.shape[1]), dtype=vectors.dtype)
        rows[np.fromiter(map(has_content, self.texts), dtype=bool, count=len(self.texts))] = vectors
        return rows

    def texts_index(self, sent_index: int) -> int:
        """The index in ``texts`` of ``sent[sent_index]``."""
        return [i for i, text in enumerate(self.texts) if has_content(text)][sent_index]

    def line(self, index: int) -> str:
        """The input line of ``texts[index]``, for messages."""
        return line_name(f"line {self.first + index + 1}", self.shard)

    @property
    def lines(self) -> str:
        """The input lines it came from, for messages."""
        first, last = self.first + 1, self.first + len(self.texts)
        return line_name(f"lines {first}-{last}" if last > first else f"line {first}", self.shard)


def line_name(lines: str, shard: Shard | None) -> str:
    """``line 3`` of the input, or of a shard (which does not know how many lines precede it)."""
    return f"input {lines}" if shard is None else f"{lines} of shard {shard}"


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
        raise file_error("--input", source, error) from None


def lines(source: str, shard: Shard | None, line_bytes: int, keep_end: bool = False) -> Iterator[Line]:
    """The lines of ``source`` (of its shard), each cut to ``line_bytes``: its first, or with
    ``keep_end`` its last; the file is closed at the end."""
    try:
        yield from _lines(source, shard, line_bytes, keep_end)
    except OSError as error:
        raise file_error("--input", source, error) from None


def _lines(source: str, shard: Shard | None, line_bytes: int, keep_end: bool) -> Iterator[Line]:
    with open_input(source) as file:
        if shard is None:
            yield from read_lines(file, line_bytes, 0, None, keep_end)
            return
        start, end = shard.byte_range(os.fstat(file.fileno()).st_size)
        if start > 0:  # the line holding byte start - 1 is the previous shard's
            file.seek(start - 1)
            start += _skip_line(file) - 1
        yield from read_lines(file, line_bytes, start, end, keep_end)


def read_lines(file: BinaryIO, limit: int, position: int, end: int | None, keep_end: bool = False) -> Iterator[Line]:
    """Lines from ``position`` (a line start) that start before ``end`` (None: to the end), each cut
    to ``limit`` bytes: its first, or with ``keep_end`` its last."""
    for number in itertools.count(1):
        if end is not None and position >= end:
            return
        head = file.readline(limit + 2)  # room for a line end after `limit` bytes
        if not head:
            return
        data = head.removesuffix(b"\n").removesuffix(b"\r")
        cut = len(data) > limit
        rest = 0
        if cut and not head.endswith(b"\n"):
            rest, data = _line_end(file, head, limit) if keep_end else (_skip_line(file), data)
        yield Line(number, position, data[-limit:] if keep_end else data[:limit], cut)
        position += len(head) + rest


def _line_end(file: BinaryIO, head: bytes, keep: int) -> tuple[int, bytes]:
    """Read up to the end of the line ``head`` began (its newline included): how many bytes that was,
    and the line's last ``keep`` bytes without its line end. Those and one read's chunk are all it holds."""
    held, read = bytearray(head), 0
    while chunk := file.readline(SKIP_CHUNK):
        read += len(chunk)
        held += chunk
        del held[: -(keep + 2)]  # room for a line end after them
        if chunk.endswith(b"\n"):
            break
    return read, bytes(held).removesuffix(b"\n").removesuffix(b"\r")[-keep:]


def _skip_line(file: BinaryIO) -> int:
    """Read up to the end of the current line (its newline included); how many bytes that was."""
    skipped = 0
    while chunk := file.readline(SKIP_CHUNK):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


class CorpusReader:
    """The texts of ``source`` (of its shard), cut into spans: each line's text is the line, or
    with ``jsonl_field`` that field of the line's JSON object, made to fit ``limits`` (cut with
    ``truncate``, else refused naming the line)."""

    def __init__(self, source: str, jsonl_field: str | None, limits: Limits, shard: Shard | None = None) -> None:
        self._source = source
        self._field = jsonl_field
        self._limits = limits
        self._shard = shard

    def count(self) -> int | None:
        """How many texts there are, for the progress bar; None for stdin."""
        if self._source == STDIN:
            return None
        return sum(1 for _ in lines(self._source, self._shard, SKIP_CHUNK))

    def spans(self, size: int, held: int) -> Iterator[Span]:
        """Spans of at most ``size`` texts, each fitting in a request. With ``held`` rows already
        written, their lines are skipped unread but for the last: it comes first, alone, so its
        row can be checked against what the line says now."""
        limits = self._limits
        source = lines(self._source, self._shard, limits.line_bytes(self._field is not None), limits.truncate_left)
        if held:
            skipped = sum(1 for _ in itertools.islice(source, held - 1))
            last = next(source, None)
            if last is None:
                raise FinalError(
                    f"--output already holds {held} rows but the input has only {skipped} texts: "
                    "a resumed run needs the same input (or one that extends it)"
                )
            yield Span(held - 1, [self.text(last)], self._shard)
        texts = (self.text(line) for line in source)
        yield from cut_spans(texts, size, self._limits.request_bytes, held, self._shard)

    def text(self, line: Line) -> str:
        if (carriage_return := line.data.find(b"\r")) >= 0:
            raise self._error(
                line,
                f"a carriage return (\\r, byte {carriage_return + 1}) inside the line: lines end only at \\n or "
                "\\r\\n, so a file with CR line ends would be one text; replace it first (tr '\\r' '\\n' for CR "
                "line ends, tr -d '\\r' for stray ones)",
            )
        if line.cut and self._field is not None:
            limit = self._limits.line_bytes(jsonl=True)
            raise self._error(line, f"a JSONL line longer than {limit} bytes, more than a request carries")
        text = self._field_of(line, self._decode(line)) if self._field else self._decode(line)
        return self._fit(line, text)

    def _decode(self, line: Line) -> str:
        data = _whole(line.data, self._limits.truncate_left) if line.cut else line.data
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self._error(line, f"not UTF-8 (byte {error.start + 1}: {error.reason})") from None

    def _field_of(self, line: Line, decoded: str) -> str:
        field = self._field
        try:
            record = json.loads(decoded)
        except json.JSONDecodeError as error:
            raise self._error(line, f"not a JSON object ({error.msg})") from None
        if not isinstance(record, dict) or field not in record:
            raise self._error(line, f"no field {field!r}")
        text = record[field]
        if not isinstance(text, str):
            raise self._error(line, f"field {field!r} is not a string: {json.dumps(text)[:40]}")
        return text

    def _fit(self, line: Line, text: str) -> str:
        limits = self._limits
        if limits.truncate and limits.text_chars and len(text) > limits.text_chars:
            text = cut_chars(text, limits.text_chars, limits.truncate_left)  # the server would cut it so
        try:
            encoded = text.encode("utf-8")
        except UnicodeEncodeError:  # JSON escapes can spell a lone surrogate, which no request can carry
            raise self._error(line, f"field {self._field!r} holds a lone surrogate, not text") from None
        if len(encoded) <= limits.text_bytes and not line.cut:
            return text
        if not limits.truncate:
            raise self._error(line, f"longer than the {limits.text_bytes} bytes a request carries (--no-truncate)")
        kept = encoded[-limits.text_bytes :] if limits.truncate_left else encoded[: limits.text_bytes]
        return _whole(kept, limits.truncate_left).decode("utf-8")

    def _error(self, line: Line, message: str) -> FinalError:
        """A bad line: the same input fails the same way however often it is run."""
        where = line_name(f"line {line.number}", self._shard)
        if self._shard is not None:
            where += f" (byte {line.offset} of the input)"
        return FinalError(f"{where}: {message}")


def _whole(data: bytes, cut_at_start: bool) -> bytes:
    """``data``, cut from a longer text at its start or at its end, without the character the cut split."""
    return _past_a_split_character(data) if cut_at_start else _whole_characters(data)


def _past_a_split_character(data: bytes) -> bytes:
    """``data`` past the continuation bytes (at most 3) of a UTF-8 character that a cut split, if it did."""
    start = 0
    while start < min(3, len(data)) and 0x80 <= data[start] < 0xC0:
        start += 1
    return data[start:]


def _whole_characters(data: bytes) -> bytes:
    """``data`` cut short of a UTF-8 character that the cut split, if it did."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:  # ASCII: nothing split
            return data
        if byte >= 0xC0:  # a lead byte: whole if its sequence fits in what follows it
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= needed else data[:-back]
    return data


def cut_spans(texts: Iterator[str], size: int, request_bytes: int, first: int, shard: Shard | None) -> Iterator[Span]:
    """Spans of at most ``size`` texts weighing at most ``request_bytes``, the first starting at row
    ``first``; at a bad line, the texts before it, then its error (a re-run starts at that line)."""
    for chunk in split_texts(texts, size, request_bytes):
        yield Span(first, chunk, shard)
        first += len(chunk)


class ThreadedSpans:
    """Spans from a blocking iterator, read in a daemon thread a span ahead: a pipe that stalls
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
