"""The Python client's keyword arguments -> a GenerateRequest.

Messages, tools and tool_choice are taken in OpenAI's shapes (or as the protobuf messages):

    messages=[{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "call_…", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}]},
              {"role": "tool", "tool_call_id": "call_…", "content": "18 C"}]
    tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}]
    tool_choice="auto" | "none" | "required" | "get_weather" | {"type": "function", "function": {"name": ...}}
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from llmserve.client.results import ToolCall
from llmserve.v1 import inference_pb2 as pb

PRIORITIES = {"low": pb.PRIORITY_LOW, "normal": pb.PRIORITY_NORMAL, "high": pb.PRIORITY_HIGH}
_CHOICE_KINDS = ("none", "auto", "required")


def _arguments_json(arguments: str | Mapping[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _tool_call(call: Mapping[str, Any] | ToolCall | pb.ToolCall) -> pb.ToolCall:
    if isinstance(call, pb.ToolCall):
        return call
    if isinstance(call, ToolCall):
        return pb.ToolCall(id=call.id, name=call.name, arguments_json=call.arguments)
    function = call["function"]
    return pb.ToolCall(id=call["id"], name=function["name"], arguments_json=_arguments_json(function["arguments"]))


def _message(m: Mapping[str, Any] | pb.ChatMessage) -> pb.ChatMessage:
    if isinstance(m, pb.ChatMessage):
        return m
    return pb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id") or "",
                          tool_calls=[_tool_call(c) for c in m.get("tool_calls") or ()])


def messages_of(messages: Sequence[Mapping[str, Any] | pb.ChatMessage] | None) -> list[pb.ChatMessage]:
    return [_message(m) for m in messages or ()]


def _tool(t: Mapping[str, Any] | pb.Tool) -> pb.Tool:
    """A tool in OpenAI's shape ({"type": "function", "function": {...}}), flat ({"name", ...}) or pb."""
    if isinstance(t, pb.Tool):
        return t
    f = t.get("function", t)
    parameters = f.get("parameters")
    return pb.Tool(name=f["name"], description=f.get("description") or "", strict=bool(f.get("strict")),
                   parameters_json_schema=json.dumps(parameters) if parameters is not None else "")


def _tool_choice(choice: str | Mapping[str, Any] | None) -> pb.ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, Mapping):
        return pb.ToolChoice(function_name=choice["function"]["name"])
    tool_choice = pb.ToolChoice()
    if choice in _CHOICE_KINDS:
        setattr(tool_choice, choice, True)
    else:
        tool_choice.function_name = choice
    return tool_choice


def build_request(prompt: str | None = None, messages=None, *, model: str = "", max_new_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  stop: Sequence[str] = (), seed: int | None = None, repetition_penalty: float | None = None,
                  priority: str | None = None, request_id: str | None = None,
                  response_format: pb.ResponseFormat | None = None, ignore_eos: bool | None = None,
                  n: int | None = None, logprobs: bool = False, top_logprobs: int | None = None,
                  tools: Sequence[Mapping[str, Any] | pb.Tool] = (),
                  tool_choice: str | Mapping[str, Any] | None = None,
                  parallel_tool_calls: bool | None = None) -> pb.GenerateRequest:
    """A GenerateRequest; unset sampling fields stay unset (server defaults). request_id defaults to a uuid.

    Args:
        response_format: structured output, e.g. `pb.ResponseFormat(json_schema=json.dumps(schema))`.
        n: how many choices (1-16); each chunk and `Completion.choices` entry names its choice.
        logprobs, top_logprobs: per-token log probabilities, with that many alternatives (0-20).
        tools, tool_choice, parallel_tool_calls: function calling (module docstring; docs/tools.md).
    """
    sampling = pb.SamplingParams(stop=list(stop), response_format=response_format, logprobs=logprobs)
    values = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                  repetition_penalty=repetition_penalty, ignore_eos=ignore_eos, top_logprobs=top_logprobs)
    for name, value in values.items():
        if value is not None:
            setattr(sampling, name, value)
    request = pb.GenerateRequest(model=model, prompt=prompt or "", messages=messages_of(messages), sampling=sampling,
                                 request_id=request_id or uuid.uuid4().hex, n=n or 0,
                                 priority=PRIORITIES[priority] if priority else pb.PRIORITY_UNSPECIFIED,
                                 tools=[_tool(t) for t in tools], tool_choice=_tool_choice(tool_choice))
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    return request
