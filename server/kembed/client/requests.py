"""How texts become requests: what a request may carry (the server's limits, from ``Info``, and the
connection's), the cut of a list into consecutive requests within them, and the request classes.
Shared by the library (:mod:`.aio`) and the corpus command."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kembed.client.connection import Connection
from kembed.v1 import embedder_pb2 as pb

# What a request carries besides its texts (request_id, dimensions, flags, and a prompt: at most 1,024
# characters of up to 4 bytes), and each text besides its bytes (a field tag and a length): room kept
# in the message limit.
REQUEST_ENVELOPE_BYTES = 1024 + 4 * 1024
TEXT_ENVELOPE_BYTES = 6
# What an answer carries besides its rows: a token count a row (at most 5 bytes, packed), the
# request_id and timings; room for 2,048 rows.
ANSWER_ENVELOPE_BYTES = 16 * 1024
# The requests' classes, by the label the commands and the library take: the proto's PRIORITY_* names, lower case.
PRIORITIES = tuple(pb.Priority.Name(value).removeprefix("PRIORITY_").lower() for value in pb.Priority.values())


def message_bytes(connection: Connection, info: pb.InfoResponse) -> int:
    """The largest request: the connection's message limit, and the server's when it says one."""
    if info.max_message_bytes:
        return min(connection.max_message_bytes, info.max_message_bytes)
    return connection.max_message_bytes


def priority(label: str) -> str:
    """A label of :data:`PRIORITIES` as the proto's enum name; any other is refused, naming the argument."""
    if label not in PRIORITIES:
        raise ValueError(f"priority: {label!r} is not one of {', '.join(PRIORITIES)}")
    return f"PRIORITY_{label.upper()}"


def split_texts(texts: Iterable[str], items: int, request_bytes: int) -> Iterator[list[str]]:
    """Consecutive runs of at most ``items`` texts (0: any number) weighing at most ``request_bytes``
    with their envelopes; a text heavier than that goes alone. If ``texts`` fails, the texts read
    before the failure come first, then its error."""
    chunk: list[str] = []
    weight = 0
    try:
        for text in texts:
            cost = len(text.encode("utf-8")) + TEXT_ENVELOPE_BYTES
            if chunk and (len(chunk) == items or weight + cost > request_bytes):
                yield chunk
                chunk, weight = [], 0
            chunk.append(text)
            weight += cost
    except Exception:
        if chunk:
            yield chunk
        raise
    if chunk:
        yield chunk


@dataclass(frozen=True)
class Prompt:
    """The prompt the server puts before each text: at most one of these; none, the model's default
    (``prompt=""``: no prompt at all)."""

    name: str = ""  # one of the model's prompts (Info.prompts)
    text: str | None = None  # the prompt's text itself
    input_type: str = ""  # query, passage or document: the model's prompt for that side


NO_PROMPT = Prompt()


@dataclass(frozen=True)
class Options:
    """What every request of one ``embed`` call carries besides its texts."""

    normalize: bool = True
    dimensions: int = 0
    truncate: bool = False
    priority: str = "interactive"
    chunk: bool | None = None  # None: the server's default
    prompt: Prompt = NO_PROMPT
    encoding: str = "float32"  # or int8, uint8, binary, ubinary: quantized by the server (docs/api.md)
    truncation_direction: str = "right"  # or "left": truncate keeps a text's end


@dataclass(frozen=True)
class Limits:
    """What one request may carry, by the server's ``Info`` and the connection."""

    items: int  # 0: the server did not say
    request_bytes: int  # what a request's texts may weigh, their envelopes included
    text_chars: int  # 0: the server did not say
    chunks: int = 0  # the most chunks an input is embedded as with chunk (0: the server did not say)
    chunk_by_default: bool = False  # the server chunks a request that sets neither chunk nor truncate

    @classmethod
    def of(cls, connection: Connection, info: pb.InfoResponse) -> Limits:
        """The server's limits; the texts a request carries also within the rows of float32 an answer
        the connection receives may hold (2,048 rows of 4,096 dimensions are 32 MiB)."""
        request_bytes = message_bytes(connection, info) - REQUEST_ENVELOPE_BYTES
        items = info.max_batch_items
        if items and info.dimensions:
            items = max(1, min(items, (connection.max_message_bytes - ANSWER_ENVELOPE_BYTES) // (4 * info.dimensions)))
        return cls(items, request_bytes, info.max_text_chars, info.max_chunks_per_input, info.chunk_long_inputs)

    def chunked(self, options: Options) -> bool:
        """Whether the server embeds these options' long texts as chunks: as they say, else its default."""
        return options.chunk if options.chunk is not None else self.chunk_by_default and not options.truncate

    def texts_per_request(self, options: Options) -> int:
        """Texts a request carries: with chunking, as many as fit the server's items however many
        chunks each needs (the client does not tokenize, so it counts each at the most)."""
        if self.chunked(options) and self.items and self.chunks:
            return max(1, self.items // self.chunks)
        return self.items


@dataclass(frozen=True)
class Part:
    """One request of a list split into several: ``first`` is the list's index of its first text."""

    first: int
    request: pb.EmbedRequest

    def __len__(self) -> int:
        return len(self.request.texts)

    def split(self, texts: int) -> tuple[Part, Part]:
        """Its first ``texts`` texts and the rest, as two parts with the same options."""
        head, tail = pb.EmbedRequest(), pb.EmbedRequest()
        head.CopyFrom(self.request)
        del head.texts[texts:]
        tail.CopyFrom(self.request)
        del tail.texts[:texts]
        return Part(self.first, head), Part(self.first + texts, tail)


def plan(texts: Sequence[str], options: Options, limits: Limits) -> list[Part]:
    """The requests that carry ``texts`` in order, each within ``limits``. With ``truncate`` a text is
    cut to the server's character limit here, as the server would cut it, so it weighs no more."""
    kind, encoding = priority(options.priority), encoding_of(options.encoding)
    direction = direction_of(options.truncation_direction)
    if options.truncate and limits.text_chars:
        texts = [cut_chars(text, limits.text_chars, direction == LEFT) for text in texts]
    parts, first = [], 0
    for run in split_texts(texts, limits.texts_per_request(options), limits.request_bytes) if texts else [[]]:
        request = pb.EmbedRequest(
            texts=run,
            normalize=options.normalize,
            dimensions=options.dimensions,
            truncate=options.truncate,
            priority=kind,
            chunk=options.chunk,
            prompt_name=options.prompt.name,
            prompt=options.prompt.text,  # None leaves it unset: "" is no prompt, unset the default
            input_type=options.prompt.input_type,
            encoding=encoding,
            truncation_direction=direction,
        )
        parts.append(Part(first, request))
        first += len(run)
    return parts


ENCODINGS = ("float32", "int8", "uint8", "binary", "ubinary")
# Each encoding's values as numpy reads them, and how many values a row of ``d`` dimensions holds.
_ROWS = {
    pb.ENCODING_FLOAT32: ("<f4", lambda d: d),
    pb.ENCODING_INT8: ("i1", lambda d: d),
    pb.ENCODING_UINT8: ("u1", lambda d: d),
    pb.ENCODING_BINARY: ("i1", lambda d: -(-d // 8)),
    pb.ENCODING_UBINARY: ("u1", lambda d: -(-d // 8)),
}


# Which end ``truncate`` cuts, by the label the commands and the library take (TEI's values, lower case).
TRUNCATION_DIRECTIONS = ("right", "left")
LEFT = "TRUNCATION_DIRECTION_LEFT"


def cut_chars(text: str, chars: int, left: bool) -> str:
    """``text`` cut to ``chars`` characters (more than 0) as a truncating server cuts it: its first
    ones, or truncating left its last."""
    return text[-chars:] if left else text[:chars]


def direction_of(name: str) -> str:
    """``right`` or ``left``, in any case (TEI writes ``Left``), as the proto's enum name; any other is
    refused, naming the argument."""
    if not isinstance(name, str) or name.lower() not in TRUNCATION_DIRECTIONS:
        raise ValueError(f"truncation_direction: {name!r} is not right or left (in any case)")
    return f"TRUNCATION_DIRECTION_{name.upper()}"


def encoding_of(name: str) -> str:
    """An encoding of :data:`ENCODINGS` as the proto's enum name; any other is refused, naming the argument."""
    if name not in ENCODINGS:
        raise ValueError(f"encoding: {name!r} is not one of {', '.join(ENCODINGS)}")
    return f"ENCODING_{name.upper()}"


def decode(response: pb.EmbedResponse) -> np.ndarray:
    """The response's rows as a [count, values a row] array in its encoding: float32 [count,
    dimensions], int8 or uint8 [count, dimensions], binary or ubinary [count, ceil(dimensions / 8)]."""
    dtype, width = _ROWS[response.encoding]
    return np.frombuffer(response.embeddings, dtype=dtype).reshape(response.count, width(response.dimensions))
