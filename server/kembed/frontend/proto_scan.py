"""A serialized EmbedRequest walked on the wire before protobuf parses it: gRPC reads a whole
message before a handler runs, and protobuf parses it whole, so a message of more than
:data:`WHOLE_MESSAGE_BYTES` is first walked (:func:`scan`: a bounded number of steps, each a few
bytes) and refused if it holds more items than a request may. Five million texts are never parsed.
Pure: bytes in, a reason out; it knows the proto's field numbers, not its generated code.
"""

from __future__ import annotations

from kembed.frontend.call import Limits

# A message up to this size is parsed without a scan: at most a few thousand fields, well under a millisecond.
WHOLE_MESSAGE_BYTES = 8192
# EmbedRequest's fields besides texts: a message with more fields than texts may hold and these is refused.
OTHER_FIELDS = 16
TEXTS_FIELD, TOKENS_FIELD, LENGTHS_FIELD = 1, 2, 2  # EmbedRequest.texts, .tokens; TokenIds.lengths
_LOW_BYTES = bytes(range(128))  # a varint's last byte: one per varint in a packed field


def scan(data: bytes, limits: Limits) -> str | None:
    """Why a serialized EmbedRequest must not be parsed, or None. Walks its fields without reading
    them: at most ``max_items`` texts and lengths, and a bounded number of fields in all."""
    texts, fields_left, position, end = 0, limits.max_items + OTHER_FIELDS, 0, len(data)
    while position < end:
        fields_left -= 1
        if fields_left < 0:
            return f"more than {limits.max_items + OTHER_FIELDS} fields"
        number, wire, position = _key(data, position)
        if wire != 2:
            position = _skip(data, position, wire)
            continue
        size, position = _varint(data, position)
        if number == TEXTS_FIELD:
            texts += 1
            if texts > limits.max_items:
                return f"texts: more than {limits.max_items} texts, at most {limits.max_items} per request"
        elif number == TOKENS_FIELD and _lengths(data[position : position + size], limits.max_items) > limits.max_items:
            return f"tokens.lengths: more than {limits.max_items} sequences, at most {limits.max_items} per request"
        position += size
    return None


def _lengths(tokens: bytes, bound: int) -> int:
    """How many lengths a serialized TokenIds holds, packed or not; past ``bound``, a number above it."""
    count, position, end, steps = 0, 0, len(tokens), bound + OTHER_FIELDS
    while position < end and count <= bound:
        steps -= 1
        if steps < 0:
            return bound + 1
        number, wire, position = _key(tokens, position)
        if number == LENGTHS_FIELD and wire == 0:
            count += 1
            position = _skip(tokens, position, 0)
        elif wire == 2:
            size, position = _varint(tokens, position)
            if number == LENGTHS_FIELD:  # packed: one varint per byte under 128
                count += size - len(tokens[position : position + size].translate(None, _LOW_BYTES))
            position += size
        else:
            position = _skip(tokens, position, wire)
    return count


def _key(data: bytes, position: int) -> tuple[int, int, int]:
    key, position = _varint(data, position)
    return key >> 3, key & 7, position


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    for _ in range(10):
        byte = data[position] if position < len(data) else 0
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    return value, position


def _skip(data: bytes, position: int, wire: int) -> int:
    if wire == 0:
        return _varint(data, position)[1]
    return position + {1: 8, 5: 4}.get(wire, len(data))  # any other wire type ends the walk: protobuf judges it
