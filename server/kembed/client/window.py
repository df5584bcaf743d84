"""How much a client sends at once, paced by the server's refusals: the corpus command's stream
(:mod:`.corpus.stream`) and the library's ``embed`` (:mod:`.aio`) both keep these.

:class:`Window` is how many requests are out at once, AIMD with TCP's slow start; :class:`RequestSize`
how many texts one carries, halved when even a window of one or two is refused (what the server
cannot take at once is then the request's size, not the number of requests) and grown by a quarter
on each answer of that size.
"""

from __future__ import annotations


class Window:
    """How many requests may be out at once: AIMD, with TCP's slow start. ``epoch`` counts the
    cuts, so that the requests refused together (sent before the cut) cut it once."""

    def __init__(self, largest: int) -> None:
        self.largest = largest
        self.limit = 1.0
        self.threshold = float(largest)
        self.epoch = 0

    def admits(self, in_flight: int) -> bool:
        return in_flight < int(self.limit)

    def refused(self, sent_in_epoch: int) -> None:
        if sent_in_epoch < self.epoch:
            return  # already cut for: it was on the wire before the cut
        self.threshold = max(1.0, self.limit / 2)
        self.limit = 1.0
        self.epoch += 1

    def succeeded(self) -> None:
        grown = self.limit + 1 if self.limit < self.threshold else self.limit + 1 / self.limit
        self.limit = min(float(self.largest), grown)


class RequestSize:
    """How many texts the next request carries, at most ``largest``; from ``start`` (default: ``largest``)."""

    def __init__(self, largest: int, start: int | None = None) -> None:
        self.largest = largest
        self.texts = largest if start is None else max(1, min(start, largest))

    def refused(self, texts: int) -> None:
        """Half of the refused request's size: requests refused together shrink it once, not each."""
        self.texts = min(self.texts, max(1, texts // 2))

    def succeeded(self, texts: int) -> None:
        if texts >= self.texts:
            self.texts = min(self.largest, self.texts + max(1, self.texts // 4))
