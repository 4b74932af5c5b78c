"""OpenAI request bodies → `GenerateRequest`, with a 400 naming the field for a wrong type.

Unknown fields are ignored (clients send many); the values themselves are checked by the
same validation as gRPC requests once the flow has the `GenerateRequest`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmserve.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CANCELLED: "stop"}
_NUMBER = (int, float)


@dataclass
class Parsed:
    request: pb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    user: str = ""


def _get(body: dict, name: str, types: tuple[type, ...], what: str) -> Any:
    """body[name] if present and not null, after a type check (bool is no number here)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise InvalidArgument(name, f"must be {what}")
    return value


def _sampling(body: dict) -> pb.SamplingParams:
    sampling = pb.SamplingParams()
    max_tokens = _get(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None:
        if max_tokens < 0:
            raise InvalidArgument("max_tokens", "must be >= 0")
        sampling.max_new_tokens = max_tokens
    for name in ("temperature", "top_p", "repetition_penalty"):
        if (value := _get(body, name, _NUMBER, "a number")) is not None:
            setattr(sampling, name, float(value))
    if (top_k := _get(body, "top_k", (int,), "an integer")) is not None:
        sampling.top_k = top_k
    if (seed := _get(body, "seed", (int,), "an integer")) is not None:
        if seed < 0:
            raise InvalidArgument("seed", "must be >= 0")
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
    return stops


def _common(body: dict, request: pb.GenerateRequest) -> Parsed:
    request.model = _get(body, "model", (str,), "a string") or ""
    request.sampling.CopyFrom(_sampling(body))
    if _get(body, "n", (int,), "an integer") not in (None, 1):
        raise InvalidArgument("n", "only n = 1 is supported")
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
    return json.dumps(schema)


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
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
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
        request.messages.add(role=message["role"], content=_content(message, i))
    return _common(body, request)


def parse_completion(body: dict) -> Parsed:
    """A /v1/completions body (one prompt string)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidArgument("prompt", "must be a string (or a list of one string)")
    return _common(body, pb.GenerateRequest(prompt=prompt))
