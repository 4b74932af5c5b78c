"""OpenAI's tool-calling shapes <-> the protobuf ones: `tools`, `tool_choice`, `parallel_tool_calls`,
assistant `tool_calls` and `tool` turns in the request; `message.tool_calls` in the response.

Types are checked here (a 400 naming the field); the values (names, schemas, ids) by the shared
validation (gateway/tool_calls.py), as for a gRPC request.
"""

from __future__ import annotations

import json
from typing import Any

from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb

_CHOICES = {"none", "auto", "required"}


def _typed(value: Any, types: type | tuple[type, ...], field: str, what: str) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)) \
            or not isinstance(value, types):
        raise InvalidArgument(field, f"must be {what}")
    return value


def _json_text(value: Any, field: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (RecursionError, ValueError, TypeError):
        raise InvalidArgument(field, "nested too deeply or not encodable") from None


def _tool(entry: Any, i: int) -> pb.Tool:
    field = f"tools[{i}]"
    _typed(entry, dict, field, "an object")
    if entry.get("type", "function") != "function":
        raise InvalidArgument(f"{field}.type", "must be function")
    function = _typed(entry.get("function"), dict, f"{field}.function", "an object")
    if function is None:
        raise InvalidArgument(f"{field}.function", "required")
    tool = pb.Tool(name=_typed(function.get("name"), str, f"{field}.function.name", "a string") or "",
                   description=_typed(function.get("description"), str, f"{field}.function.description",
                                      "a string") or "",
                   strict=bool(_typed(function.get("strict"), bool, f"{field}.function.strict", "a boolean")))
    parameters = _typed(function.get("parameters"), dict, f"{field}.function.parameters", "an object")
    if parameters is not None:
        tool.parameters_json_schema = _json_text(parameters, f"{field}.function.parameters")
    return tool


def _tool_choice(value: Any, out: pb.ToolChoice) -> None:
    if isinstance(value, str):
        if value not in _CHOICES:
            raise InvalidArgument("tool_choice", "must be none, auto, required or a function")
        setattr(out, value, True)
        return
    _typed(value, dict, "tool_choice", "a string or an object")
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if value.get("type") != "function" or not isinstance(name, str):
        raise InvalidArgument("tool_choice", 'an object must be {"type": "function", "function": {"name": ...}}')
    out.function_name = name


def parse_tools(body: dict, request: pb.GenerateRequest) -> None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body into `request`."""
    tools = _typed(body.get("tools"), list, "tools", "a list of tools")
    request.tools.extend(_tool(entry, i) for i, entry in enumerate(tools or ()))
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], request.tool_choice)
    parallel = _typed(body.get("parallel_tool_calls"), bool, "parallel_tool_calls", "a boolean")
    if parallel is not None:
        request.parallel_tool_calls = parallel


def _history_call(entry: Any, field: str) -> pb.ToolCall:
    _typed(entry, dict, field, "an object")
    function = _typed(entry.get("function"), dict, f"{field}.function", "an object") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, dict):     # some clients send the object itself
        arguments = _json_text(arguments, f"{field}.function.arguments")
    return pb.ToolCall(id=_typed(entry.get("id"), str, f"{field}.id", "a string") or "",
                       name=_typed(function.get("name"), str, f"{field}.function.name", "a string") or "",
                       arguments_json=_typed(arguments, str, f"{field}.function.arguments", "a string") or "")


def message_tool_fields(message: dict, i: int, out: pb.ChatMessage) -> None:
    """An assistant turn's `tool_calls` and a tool turn's `tool_call_id` into `out`."""
    calls = _typed(message.get("tool_calls"), list, f"messages[{i}].tool_calls", "a list")
    out.tool_calls.extend(_history_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls or ()))
    out.tool_call_id = _typed(message.get("tool_call_id"), str, f"messages[{i}].tool_call_id", "a string") or ""


def openai_tool_calls(calls) -> list[dict]:
    """`message.tool_calls` of a whole response."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in calls]
