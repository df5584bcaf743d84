"""A ``POST /v1/embeddings`` body read as it arrives, chunk by chunk (:class:`Body`), or whole
(:func:`parse`): yajl (ijson's C backend) turns each chunk into events, and the walk over them is
the one place REST input meets the limits and the rules of JSON that yajl leaves out (a field given
twice, half a surrogate pair). A body gets the same answer however it was cut: its first fault, in
the order of its bytes, is the one named. Each item is checked as it comes (the item count, each
text's characters, each id's range and each sequence's length, no empty item, no nesting past an
array of arrays of ids, no field the API does not have), so a body that breaks a limit is refused at
the item that breaks it, before the rest is read or anything sized by it is built; texts are kept as
strings, ids straight in an int32 buffer. What the fields mean, and the call they make, is the
API's (:mod:`kembed.frontend.openai_api`).
"""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

import ijson
import numpy as np

from kembed.domain.errors import Field, InvalidInput
from kembed.domain.inputs import Sequences
from kembed.frontend.call import Limits, Texts, cut_chars
from kembed.frontend.openai_api import (
    EXTENSIONS,
    FIELDS,
    INPUT_SHAPES,
    ITEM_SHAPES,
    MAX_FIELD_CHARS,
    MAX_TOKEN_ID,
    OPENAI_FIELDS,
    ApiError,
    Embeddings,
    embeddings,
    invalid,
    truncates_left,
)

# ijson's events for a JSON value, as a message names it.
_VALUES = {"null": "null", "boolean": "true or false", "number": "a number", "string": "a string"}
_VALUES |= {"start_map": "an object", "start_array": "an array"}


_YAJL = ijson.get_backend("yajl2_c")  # C: a Python backend would cost ten times as much per event
# A high surrogate's escape (\uD800-\uDBFF) that no low one follows: yajl reads it as "?" or as a
# wrong character (a lone low one it turns into bytes that are not UTF-8, which ijson refuses). An
# escape only if an even number of backslashes comes before it. What may begin the low escape after
# a high one is _LOW_START.
_LONE_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
_LOW_START = re.compile(rb"(?:\\(?:u(?:[dD](?:[c-fC-F][0-9a-fA-F]?)?)?)?)?")
ESCAPE_BYTES = 6  # \uXXXX


def parse(
    body: bytes, served: tuple[str, ...], limits: Limits, peer: str = "", timeout_s: float | None = None
) -> Embeddings:
    """A body that has arrived whole: read by :class:`Body` in one chunk."""
    reader = Body(limits)
    reader.feed(body)
    return reader.finish(served, peer, timeout_s)


class _Surrogates:
    """Finds a high surrogate alone in a body's escapes, chunk by chunk: a chunk's end may cut an
    escape, or a high one from the low one that must follow it, so what it cannot decide yet is kept
    (after the parity of the backslashes before it) and read again with the next chunk."""

    def __init__(self) -> None:
        self._kept = b""  # the end of what came before, already parsed

    def find(self, chunk: bytes, last: bool = False) -> tuple[int, bytes] | None:
        """The first high surrogate alone that the body so far shows: where its escape ends in
        ``chunk`` (0 or less: in what came before), and the escape; ``last``: nothing follows."""
        data, before = self._kept + chunk, len(self._kept)
        match = _LONE_HIGH.search(data)
        while match is not None and _backslashes(data, match.start()) % 2:  # an escaped backslash, then "u"
            match = _LONE_HIGH.search(data, match.start() + 1)
        if match is None:
            # An escape that the chunk's end cuts begins in its last 5 bytes; of the backslashes
            # before them, what counts is whether their number is odd.
            start = max(0, len(data) - ESCAPE_BYTES + 1)
            self._kept = data[start - _backslashes(data, start) % 2 :]
            return None
        end = match.end()
        after = data[end : end + ESCAPE_BYTES]
        if last or len(after) == ESCAPE_BYTES or not _LOW_START.fullmatch(after):
            return end - before, match.group()
        self._kept = data[match.start() :]  # its low one may come next
        return None


def _backslashes(data: bytes, end: int) -> int:
    """How many backslashes come right before ``end``."""
    if end == 0 or data[end - 1] != ord("\\"):
        return 0
    return end - len(data[:end].rstrip(b"\\"))


class _Kind(Enum):
    TEXTS = "texts"
    IDS = "ids"  # one array of token ids
    NESTED = "nested"  # an array of arrays of token ids


class Body:
    """One ``POST /v1/embeddings`` body, walked as it arrives: :meth:`feed` each chunk (it raises at
    the first item that breaks a limit), then :meth:`finish`. The work per chunk is bounded by the
    chunk's size, and what is kept by the limits. Raises :class:`ApiError`, or
    :class:`InvalidInput` for :func:`failed` to name."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._events: list[tuple[str, Any]] = ijson.sendable_list()
        self._parser: Any = _YAJL.basic_parse_coro(self._events)
        self._surrogates = _Surrogates()
        self._depth = 0  # containers open: the body's object is 1, input's array 2, a sequence 3
        self._fields: dict[str, Any] = {}
        self._key = ""  # the field whose value comes next
        self._kind: _Kind | None = None  # what input holds, decided by its first item
        self._texts: list[str] = []
        self._chars = 0
        self._too_long: tuple[int, int] | None = None  # the first text over the limit: (its characters, index)
        self._ends: dict[int, str] = {}  # the texts over the limit, by index: their last characters, kept
        self._ids = array("i")  # int32: ids are checked to fit before they are stored
        self._lengths: list[int] = []
        self._length = 0  # ids so far in the sequence being read

    def feed(self, chunk: bytes) -> None:
        """The body's next bytes: read up to its first fault, which is raised."""
        lone = self._surrogates.find(chunk)
        if lone is None:
            self._parse(chunk)
            return
        end, escape = lone
        self._parse(chunk[: max(0, end)])  # a fault before it comes first
        raise self._lone(escape)

    def _parse(self, chunk: bytes) -> None:
        """yajl reads ``chunk``, and the events it gave are walked, those before a fault of JSON
        too: a limit that one of them breaks comes first in the body."""
        if chunk:  # yajl would read an empty one as the body's end
            self._read(lambda: self._parser.send(chunk))

    def _read(self, yajl_reads: Callable[[], object]) -> None:
        """yajl reads a chunk, or the body's end, then its events are walked; its faults are named."""
        try:
            yajl_reads()
        except (ijson.JSONError, UnicodeDecodeError) as error:
            self._walk_parsed()
            raise self._not_json(error) from None
        except (SystemError, ValueError) as error:
            if not _too_many_digits(error):
                raise
            raise self._too_many_digits() from None
        self._walk_parsed()

    def _too_many_digits(self) -> ApiError:
        """yajl read a whole number longer than Python converts to an int (4,300 digits unless
        ``sys.set_int_max_str_digits`` says otherwise): refused naming where it is. ijson leaves the
        failed number as the last event, its value not an object: that event is freed unread, and
        those before it walked."""
        events = self._events
        parsed = events[:-1] if events and events[-1][0] == "number" else events[:]
        del events[:]
        self.walk(parsed)  # a fault before it comes first
        place = self._place()
        return invalid(f"{place or 'the body'}: a number of more than {sys.get_int_max_str_digits()} digits", place)

    def _walk_parsed(self) -> None:
        try:
            self.walk(self._events)
        finally:
            del self._events[:]

    def walk(self, events: Iterable[tuple[str, Any]]) -> None:
        """Check and keep what these events of the body say (yajl's, or :func:`_events`)."""
        for event, value in events:
            if self._depth >= 2:
                self._item(event, value)
            elif self._depth == 1:
                self._field(event, value)
            elif event == "start_map":
                self._depth = 1
            else:
                raise invalid("the body must be a JSON object", None)

    def finish(self, served: tuple[str, ...], peer: str = "", timeout_s: float | None = None) -> Embeddings:
        """The whole body has been fed: the request, checked field by field; ``served`` are the model
        names this server answers to (the first is the one answers carry when the request names
        none); ``peer`` the caller's connection; ``timeout_s`` what is left of its deadline."""
        lone = self._surrogates.find(b"", last=True)
        if lone is not None:
            raise self._lone(lone[1])
        self._read(self._parser.close)  # a number that ends the body is only read now
        if "input" not in self._fields:
            raise invalid("input: missing", "input")
        if self._too_long is not None and self._fields.get("truncate") is not True:
            self._limits.check_chars(*self._too_long)
        if truncates_left(self._fields):  # a text over the limit is cut to its end, not its start
            for index, end in self._ends.items():
                self._texts[index] = end
        inputs, nested = self._inputs(), self._kind is _Kind.NESTED
        return embeddings(self._fields, inputs, nested, served, peer, timeout_s)

    def _field(self, event: str, value: Any) -> None:
        """An event in the body's object: a field's name, or its value."""
        if event == "map_key":
            if value not in FIELDS:
                raise _unknown(value)
            if value in self._fields:
                raise invalid(f"{value}: given twice", value)
            self._key = value
            self._fields[value] = None
            return
        key, self._key = self._key, ""
        if event == "end_map":
            self._depth = 0
        elif key == "input":
            if event == "start_array":
                self._depth = 2
            elif event == "string":
                self._text(value)
            else:
                raise invalid(f"input: must be {INPUT_SHAPES}", "input")
        elif event in ("start_map", "start_array"):
            raise invalid(f"{key}: an object or array is not accepted here", key)
        elif event == "string" and len(value) > MAX_FIELD_CHARS:
            raise invalid(f"{key}: longer than {MAX_FIELD_CHARS} characters", key)
        else:
            self._fields[key] = value

    def _place(self) -> str | None:
        """The field of the value being read: a text ``input[i]``, another part of input, another
        field by its name; None for a field's name."""
        if self._depth >= 2 or self._key == "input":
            return f"input[{len(self._texts)}]" if self._kind in (None, _Kind.TEXTS) else "input"
        return self._key or None

    def _lone(self, escape: bytes) -> ApiError:
        return self._not_text(f"{escape.decode()} is half a surrogate pair, alone")

    def _not_json(self, error: ijson.JSONError | UnicodeDecodeError) -> ApiError:
        if isinstance(error, UnicodeDecodeError):  # what yajl let through: overlong UTF-8, a surrogate
            return self._not_text("not UTF-8, or half a surrogate pair alone")
        return _not_json(error)

    def _not_text(self, reason: str) -> ApiError:
        """The string being read is not text: named by its place."""
        place = self._place()
        return invalid(f"{place or 'a field name'}: not text: {reason}", place)

    def _item(self, event: str, value: Any) -> None:
        """An event inside input's array: an item, an id, or where one begins or ends."""
        if self._depth == 3:  # inside one of an array of arrays of ids
            if event == "number":
                self._id(value, len(self._lengths))
            elif event == "end_array":
                self._limits.check_size(self._length, len(self._lengths), ids=True)
                self._lengths.append(self._length)
                self._length = 0
                self._depth = 2
            else:
                raise self._bad_id(event, value)
            return
        if event == "end_array":
            self._depth = 1
            if self._kind is None:
                raise invalid(f"input: must be {INPUT_SHAPES}, not empty", "input")
            if self._kind is _Kind.IDS:
                self._lengths.append(self._length)
            return
        if self._kind is None:
            self._kind = {"string": _Kind.TEXTS, "number": _Kind.IDS, "start_array": _Kind.NESTED}.get(event)
        if self._kind is _Kind.TEXTS and event == "string":
            self._text(value)
        elif self._kind is _Kind.IDS:
            if event != "number":
                raise self._bad_id(event, value)
            self._id(value, 0)
        elif self._kind is _Kind.NESTED and event == "start_array":
            self._limits.check_item(len(self._lengths))
            self._depth = 3
        else:
            raise self._bad_item(event)

    def _bad_item(self, event: str) -> ApiError:
        """An item unlike the items before it (or, first, unlike any item), named by its index."""
        index, what = len(self._texts) + len(self._lengths), _VALUES.get(event, event)
        expected = {
            None: ITEM_SHAPES,
            _Kind.TEXTS: "a string, as the items before it are",
            _Kind.NESTED: "an array of token ids, as the items before it are",
        }[self._kind]
        return invalid(f"input[{index}]: {what} is not {expected}", f"input[{index}]")

    def _bad_id(self, event: str, value: Any) -> ApiError:
        """A token id that is not one, named by its place: ``input[i][j]``, or ``input[j]`` in a lone
        array of ids."""
        what = _VALUES.get(event, event) if event != "number" else str(value)[:32]
        i, j = len(self._lengths), self._length
        place = f"input[{i}][{j}]" if self._kind is _Kind.NESTED else f"input[{j}]"
        return invalid(f"{place}: {what} is not a token id, a whole number from 0 to {MAX_TOKEN_ID}", place)

    def _text(self, text: str) -> None:
        index = len(self._texts)
        self._limits.check_item(index)
        self._limits.check_size(len(text), index)
        limit = self._limits.max_text_chars
        if len(text) > limit:  # kept cut to the limit: whether it is refused, truncate says, which may come later
            self._too_long = self._too_long or (len(text), index)
            self._ends[index] = cut_chars(text, limit, left=True)  # and which end it keeps, truncation_direction
            text = cut_chars(text, limit, left=False)
        self._texts.append(text)
        self._chars += len(text)

    def _id(self, value: Any, index: int) -> None:
        if type(value) is not int or not 0 <= value <= MAX_TOKEN_ID:  # a non-integer is a Decimal here
            raise self._bad_id("number", value)
        if self._length == self._limits.max_text_chars:  # a sequence is bounded as a text is
            raise InvalidInput(Field.INPUT, f"more than {self._length} token ids", index)
        self._ids.append(value)
        self._length += 1

    def _inputs(self) -> Texts | Sequences:
        if self._kind is _Kind.TEXTS or self._kind is None:  # None: a lone string, or nothing
            return Texts(self._texts, self._chars)
        ids = np.frombuffer(self._ids, dtype=np.int32) if self._ids else np.empty(0, dtype=np.int32)
        return Sequences(ids=ids, lengths=np.asarray(self._lengths, dtype=np.int32))


def _not_json(error: ijson.JSONError) -> ApiError:
    """yajl's message, its first line (the rest draws where it is in the text)."""
    reason = error.args[0] if error.args else ""
    text = reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)
    return invalid(f"the body is not JSON: {text.strip().splitlines()[0] if text.strip() else 'incomplete'}", None)


def _unknown(name: str) -> ApiError:
    shown = name if len(name) <= 64 else f"{name[:64]}..."
    known = ", ".join(OPENAI_FIELDS + EXTENSIONS)
    return invalid(f"{shown}: not a field of this API (it takes {known})", shown)


def _too_many_digits(error: SystemError | ValueError) -> bool:
    """Whether yajl's number was past Python's int conversion limit (ijson's C callback raises it as
    the cause of a SystemError)."""
    cause = error if isinstance(error, ValueError) else error.__cause__
    return isinstance(cause, ValueError) and "integer string conversion" in str(cause)
