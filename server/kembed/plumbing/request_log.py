"""A call's request id in every log line written about it, in the front end and in the engine.

A front end's edge sets :data:`request_id` as a call arrives (taken from the caller's
``x-request-id``, else made): the call's tasks inherit it, so every line they log names the call
without any function passing it. The engine serves many calls in one loop turn: it names the call
in a line with ``extra={"request_id": ...}`` instead, and only when the line is written, so its
rows pay nothing for ids.
"""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar

request_id: ContextVar[str] = ContextVar("request_id", default="")
MAX_CHARS = 128  # a longer offered id is replaced: it would only lengthen every line


def adopt(offered: str | None) -> str:
    """``offered`` when it is a usable id (printable ASCII, no space, at most :data:`MAX_CHARS`: a
    caller cannot break a log line or forge another), else a new one."""
    if offered and len(offered) <= MAX_CHARS and offered.isascii() and offered.isprintable() and " " not in offered:
        return offered
    return uuid.uuid4().hex


def configure(level: str, process: str) -> None:
    """The process's log lines, each naming its call's request id where it has one."""
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s {process} %(name)s: %(request)s%(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_name_the_call)


def _name_the_call(record: logging.LogRecord) -> bool:
    named = getattr(record, "request_id", None) or request_id.get()
    record.request = f"[{named}] " if named else ""
    return True
