"""Requests that protobuf refuses to parse (almost always invalid UTF-8 in a string
field) still deserve INVALID_ARGUMENT naming the field, not a transport error.
`locate_bad_utf8` walks the protobuf wire format just far enough to name it.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from llmserve.runtime.errors import InvalidArgument

# field number → (name, nested schema or None) of the string fields of each request message.
_MESSAGE = {1: ("role", None), 2: ("content", None)}
_SAMPLING = {5: ("stop", None)}
SCHEMAS = {
    "GenerateRequest": {1: ("model", None), 2: ("prompt", None), 3: ("messages", _MESSAGE),
                        4: ("sampling", _SAMPLING), 5: ("request_id", None)},
    "TokenizeRequest": {1: ("model", None), 2: ("text", None), 3: ("messages", _MESSAGE)},
    "CancelRequest": {1: ("request_id", None)},
}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def _skip(data: bytes, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    raise ValueError(f"wire type {wire_type}")


def locate_bad_utf8(data: bytes, schema: dict, prefix: str = "") -> str | None:
    """Dotted name of the first string field whose bytes are not UTF-8 (None if none found)."""
    pos, index = 0, dict[int, int]()   # field number -> occurrences so far
    while pos < len(data):
        tag, pos = _varint(data, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type != 2:
            pos = _skip(data, pos, wire_type)
            continue
        length, pos = _varint(data, pos)
        chunk, pos = data[pos:pos + length], pos + length
        if number not in schema:
            continue
        name, nested = schema[number]
        i = index[number] = index.get(number, -1) + 1
        label = f"{prefix}{name}[{i}]" if name in ("messages", "stop") else f"{prefix}{name}"
        found = locate_bad_utf8(chunk, nested, label + ".") if nested else _bad(chunk, label)
        if found:
            return found
    return None


def _bad(chunk: bytes, label: str) -> str | None:
    try:
        chunk.decode("utf-8")
        return None
    except UnicodeDecodeError:
        return label


class Unparsable:
    """Stands in for a request protobuf could not parse; the handler raises `error`."""

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def lenient(message_cls):
    """A request deserializer that turns parse failures into an `Unparsable` naming the field."""
    schema = SCHEMAS.get(message_cls.DESCRIPTOR.name, {})

    def deserialize(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError:
            try:
                field = locate_bad_utf8(data, schema)
            except (ValueError, IndexError):
                field = None
            if field:
                return Unparsable(InvalidArgument(field, "is not valid UTF-8"))
            return Unparsable(InvalidArgument("request", f"not a valid {message_cls.DESCRIPTOR.name}"))
    return deserialize
