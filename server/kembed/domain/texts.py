"""What a text must hold to be embedded: one rule for the server's edges, kembed's client and the
corpus command (``docs/api.md``, "Texts without content").

A text has content when it holds a letter, a number, a punctuation mark or a symbol (Unicode
categories L, N, P and S), U+FFFD (the replacement character) aside. A text of only whitespace,
control, format, private-use or unassigned characters and combining marks has none: tokenizers
drop such characters (all-MiniLM-L6-v2's turns each into nothing), so it would be embedded as its
special tokens alone, a vector that means nothing, as an empty text would. It is refused.

Stdlib only: the client imports it without the server's dependencies.
"""

from __future__ import annotations

import functools
import re
import unicodedata

CONTENT_CATEGORIES = "LNPS"  # a category's first letter
NOT_CONTENT = "\ufffd"  # a symbol, but what a decoder puts where it could not read
EMPTY = "an empty string"
NO_CONTENT = "no letter, digit, punctuation or symbol: only whitespace or invisible characters"
BMP_END = 0x10000
ASTRAL = chr(BMP_END)


def why_not(text: str) -> str | None:
    """Why ``text`` cannot be embedded (:data:`EMPTY`, :data:`NO_CONTENT`), or None."""
    if not text:
        return EMPTY
    return None if has_content(text) else NO_CONTENT


def has_content(text: str) -> bool:
    """Whether ``text`` holds a character that is content (the module's rule). Stops at the first,
    which is the first character of most texts; a text without one costs a few nanoseconds a
    character (the regular expression's C loop), past the Basic Multilingual Plane a lookup each."""
    candidates = _candidate()
    found = candidates.search(text)
    while found is not None:
        char = found.group()
        if char < ASTRAL or _is_content(char):
            return True
        found = candidates.search(text, found.end())
    return False


def _is_content(char: str) -> bool:
    return unicodedata.category(char)[0] in CONTENT_CATEGORIES and char != NOT_CONTENT


@functools.cache
def _candidate() -> re.Pattern[str]:
    """A content character of the Basic Multilingual Plane, or any character past it: a class of
    ranges that ``re`` matches by table (within the plane; past it, it would scan the ranges),
    built once per process from Python's Unicode database (about 15 ms)."""
    ranges, start = [], None
    for point in range(BMP_END + 1):
        content = point < BMP_END and _is_content(chr(point))
        if content and start is None:
            start = point
        elif not content and start is not None:
            ranges.append(f"{re.escape(chr(start))}-{re.escape(chr(point - 1))}")
            start = None
    return re.compile(f"[{''.join(ranges)}\U00010000-\U0010ffff]")
