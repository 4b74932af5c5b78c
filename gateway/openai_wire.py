"""OpenAI request bodies → `GenerateRequest`, with a 400 naming the field for a wrong type; the
body itself read within a size limit (413) and parsed as JSON (400 for bad UTF-8, JSON or depth).

Unknown fields are ignored (clients send many); the values themselves are checked by the
same validation as gRPC requests once the flow has the `GenerateRequest`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from gateway import logprobs
from gateway.openai_tools import message_tool_fields, parse_tools
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CANCELLED: "stop",
          pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}
_NUMBER = (int, float)


@dataclass
class Parsed:
    request: pb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    user: str = ""


_UINT32, _INT32, _UINT64 = 2**32 - 1, 2**31 - 1, 2**64 - 1


def _text(value: str, name: str) -> str:
    """`value` if it can be UTF-8 (JSON's `\\ud800` escapes decode to lone surrogates, which cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(name, "is not valid UTF-8 (a lone surrogate escape)") from None
    return value


def _get(body: dict, name: str, types: tuple[type, ...], what: str) -> Any:
    """body[name] if present and not null, after a type check (bool is no number here)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise InvalidArgument(name, f"must be {what}")
    return _text(value, name) if isinstance(value, str) else value


def _integer(body: dict, name: str, top: int) -> int | None:
    """body[name] as an integer in 0..top (the range of its protobuf field), or None when absent."""
    value = _get(body, name, (int,), "an integer")
    if value is not None and not 0 <= value <= top:
        raise InvalidArgument(name, f"must be in 0..{top}")
    return value


def _sampling(body: dict) -> pb.SamplingParams:
    sampling = pb.SamplingParams()
    max_tokens = _integer(body, "max_completion_tokens", _UINT32)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", _UINT32)
    if max_tokens is not None:
        sampling.max_new_tokens = max_tokens
    for name in ("temperature", "top_p", "repetition_penalty"):
        if (value := _get(body, name, _NUMBER, "a number")) is not None:
            setattr(sampling, name, float(value))
    if (top_k := _integer(body, "top_k", _INT32)) is not None:
        sampling.top_k = top_k
    if (seed := _integer(body, "seed", _UINT64)) is not None:
        sampling.seed = seed
    if _get(body, "ignore_eos", (bool,), "a boolean"):
        sampling.ignore_eos = True
    sampling.stop.extend(_stops(body))
    return sampling


def _stops(body: dict) -> list[str]:
    stop = _get(body, "stop", (str, list), "a string or a list of strings")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    return [_text(s, "stop") for s in stops]


def _common(body: dict, request: pb.GenerateRequest) -> Parsed:
    request.model = _get(body, "model", (str,), "a string") or ""
    request.sampling.CopyFrom(_sampling(body))
    if (n := _integer(body, "n", _UINT32)) is not None:
        if n < 1:
            raise InvalidArgument("n", "must be >= 1")
        request.n = n                                 # the upper bound: gateway/choices.py
    _response_format(body, request.sampling.response_format)
    options = _get(body, "stream_options", (dict,), "an object") or {}
    include_usage = _get(options, "include_usage", (bool,), "a boolean")
    return Parsed(request, stream=bool(_get(body, "stream", (bool,), "a boolean")),
                  include_usage=bool(include_usage), user=_get(body, "user", (str,), "a string") or "")


def _json_schema(response_format: dict) -> str:
    spec = _get(response_format, "json_schema", (dict,), "an object") or {}
    schema = _get(spec, "schema", (dict,), "an object")
    if schema is None:
        raise InvalidArgument("response_format.json_schema.schema", "required: the JSON schema object")
    try:
        return json.dumps(schema)
    except (RecursionError, UnicodeEncodeError, ValueError):
        raise InvalidArgument("response_format.json_schema.schema", "nested too deeply or not encodable") from None


def _response_format(body: dict, out: pb.ResponseFormat) -> None:
    """OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}} / {"type": "json_object"} into
    `out`; "text" (or none) leaves it unset. The schema itself is checked by the shared validation."""
    response_format = _get(body, "response_format", (dict,), "an object")
    kind = "text" if response_format is None else response_format.get("type", "text")
    if kind == "json_schema":
        out.json_schema = _json_schema(response_format)
    elif kind == "json_object":
        out.json_object = True
    elif kind != "text":
        raise InvalidArgument("response_format.type", "must be text, json_object or json_schema")


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or a list of text parts."""
    content = message.get("content")
    field = f"messages[{i}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(content, field)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return _text("".join(p["text"] for p in content), field)
    raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of text parts")


def parse_chat(body: dict) -> Parsed:
    """A /v1/chat/completions body."""
    messages = _get(body, "messages", (list,), "a list of messages")
    if not messages:
        raise InvalidArgument("messages", "required: a non-empty list of messages")
    request = pb.GenerateRequest()
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgument(f"messages[{i}]", "must be an object with a string role")
        added = request.messages.add(role=_text(message["role"], f"messages[{i}].role"), content=_content(message, i))
        message_tool_fields(message, i, added)
    parse_tools(body, request)
    parsed = _common(body, request)
    logprobs.parse_chat(body, request.sampling)
    return parsed


def parse_completion(body: dict) -> Parsed:
    """A /v1/completions body (one prompt string)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidArgument("prompt", "must be a string (or a list of one string)")
    parsed = _common(body, pb.GenerateRequest(prompt=_text(prompt, "prompt")))
    logprobs.parse_completion(body, parsed.request.sampling)
    return parsed


class BodyTooLarge(InvalidArgument):
    """A request body over the gateway's limit: HTTP 413, found while reading, never buffered whole."""

    def __init__(self, limit: int) -> None:
        super().__init__("body", f"exceeds {limit} bytes")


# A body a little over the limit is read to its end (and dropped) before the 413, so the client
# reads the answer instead of a connection reset; one beyond this many times the limit is not.
_DRAIN_FACTOR = 4


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes, at most `limit` of them held; BodyTooLarge once the declared or received
    size passes it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit * _DRAIN_FACTOR:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit * _DRAIN_FACTOR:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise BodyTooLarge(limit)
    return b"".join(chunks)


def parse_json(raw: bytes) -> dict:
    """A JSON object from the body; 400 for bad UTF-8, bad JSON, nesting beyond the parser's depth,
    or anything but an object at the top."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise InvalidArgument("body", "is not valid UTF-8") from None
    except RecursionError:
        raise InvalidArgument("body", "JSON nested too deeply") from None
    except ValueError:
        raise InvalidArgument("body", "not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body
