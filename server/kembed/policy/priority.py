"""A request's class, whatever edge carried it. The values cross the front end/engine link and are
the proto's ``Priority`` values (``kembed.v1.Priority``), so unset means interactive."""

from __future__ import annotations

from enum import IntEnum


class Priority(IntEnum):
    INTERACTIVE = 0  # a caller waits on the answer (a search query): batched first
    BATCH = 1  # throughput work (an ingest): fills what interactive traffic leaves, refused first

    @property
    def label(self) -> str:
        """The value of the ``priority`` label on metrics."""
        return self.name.lower()


# Priority(value) looks the member up through the enum machinery; on the per-request path a tuple
# index is a tenth of that (the values are 0 and 1).
BY_VALUE: tuple[Priority, ...] = tuple(Priority)
