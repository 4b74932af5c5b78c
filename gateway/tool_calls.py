"""Tool calling: the request's tools checked, and the llguidance grammar that makes every call valid.

The model writes its calls in one format, whatever its chat template (docs/tools.md):

    <tool_call>{"name": "get_weather", "arguments": {...}}</tool_call>\\n<tool_call>...</tool_call>
               └ literal, name one of the allowed ┘  └ %json: the tool's schema ┘

and the grammar per tool_choice is

    auto      start: calls | TEXT       TEXT never contains "<tool_call>": a call is the whole turn
    required  start: calls
    named     start: call of that function only, once
    none      no grammar (plain text)

with `calls: call ("\\n" call)*`, or one call when parallel_tool_calls is false. The name is a literal
of the grammar and the arguments are `%json` of that tool's own schema, so a finished call always
parses and validates. The gateway builds and checks the grammar (`grammar_of`, compiled off the loop
and charged to the tenant by gateway/response_format.py); the work item carries it
(ResolvedSampling.tool_grammar) and each worker compiles it for its vocabulary, as for a
response_format, so the guarantee holds across preemption, failover and handoff.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Any

import llguidance

from llmserve.protocol.grammar import GrammarError
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"
NAME_PREFIX = '{"name": "'
ARGUMENTS_PREFIX = '", "arguments": '
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The arguments JSON as the structured output writes it (llmserve/protocol/grammar.py): compact but readable.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class Mode(Enum):
    """What tool_choice asks of the model."""

    NONE = "none"          # no tools given, or tool_choice none: free text
    AUTO = "auto"          # text, or calls
    REQUIRED = "required"  # one call or more
    NAMED = "named"        # exactly one call of tool_choice.function_name


def mode_of(request: pb.GenerateRequest) -> Mode:
    """The request's tool mode (tools without tool_choice: auto)."""
    if not request.tools:
        return Mode.NONE
    kind = request.tool_choice.WhichOneof("kind")
    return {None: Mode.AUTO, "none": Mode.NONE, "auto": Mode.AUTO, "required": Mode.REQUIRED,
            "function_name": Mode.NAMED}[kind]


# -- admission checks (cheap: before the quota) -----------------------------------------------------------
def check_tools(request: pb.GenerateRequest, max_schema_bytes: int) -> None:
    """INVALID_ARGUMENT naming the field for a malformed tool list, tool_choice or tool history.

    Args:
        max_schema_bytes: the structured-output limit, for all the tools' schemas together.
    """
    _check_history(request.messages)
    if not request.tools:
        if request.HasField("tool_choice") and request.tool_choice.WhichOneof("kind") not in (None, "none"):
            raise InvalidArgument("tool_choice", "needs tools")
        return
    if not request.messages:
        raise InvalidArgument("tools", "need chat messages, not a plain prompt")
    if len(request.tools) > MAX_TOOLS:
        raise InvalidArgument("tools", f"at most {MAX_TOOLS} tools")
    names: set[str] = set()
    size = 0
    for i, tool in enumerate(request.tools):
        _check_tool(tool, i, names)
        size += len(tool.parameters_json_schema.encode("utf-8", "surrogatepass"))
    if size > max_schema_bytes:
        raise InvalidArgument("tools", f"parameter schemas exceed {max_schema_bytes} bytes together")
    _check_choice(request, names)


def _check_tool(tool: pb.Tool, i: int, names: set[str]) -> None:
    if not TOOL_NAME.fullmatch(tool.name):
        raise InvalidArgument(f"tools[{i}].name", "must be 1..64 characters of A-Z a-z 0-9 _ -")
    if tool.name in names:
        raise InvalidArgument(f"tools[{i}].name", f"duplicate tool name {tool.name!r}")
    names.add(tool.name)
    schema = _schema(tool)
    if schema.get("type", "object") != "object":
        raise InvalidArgument(f"tools[{i}].parameters", "must be a JSON schema of type object")


def _schema(tool: pb.Tool) -> dict[str, Any]:
    """The tool's parameters schema as a dict (empty: any object)."""
    if not tool.parameters_json_schema:
        return dict(_ANY_OBJECT)
    try:
        schema = json.loads(tool.parameters_json_schema)
    except (ValueError, RecursionError):
        raise InvalidArgument(f"tools.{tool.name}.parameters", "is not valid JSON") from None
    if not isinstance(schema, dict):
        raise InvalidArgument(f"tools.{tool.name}.parameters", "must be a JSON object")
    return schema


def _check_choice(request: pb.GenerateRequest, names: set[str]) -> None:
    choice = request.tool_choice
    kind = choice.WhichOneof("kind")
    if kind == "function_name" and choice.function_name not in names:
        raise InvalidArgument("tool_choice", f"names no tool of this request: {choice.function_name!r}")
    if kind in ("none", "auto", "required") and not getattr(choice, kind):
        raise InvalidArgument(f"tool_choice.{kind}", "must be true when set")
    if mode_of(request) is not Mode.NONE and request.sampling.response_format.WhichOneof("kind"):
        raise InvalidArgument("sampling.response_format", "cannot be combined with tools unless "
                                                          "tool_choice is none")


def _check_history(messages) -> None:
    """Assistant turns may carry calls; a tool turn answers one by its id."""
    for i, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise InvalidArgument(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
        for j, tool_call in enumerate(message.tool_calls):
            _check_history_call(tool_call, f"messages[{i}].tool_calls[{j}]")
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidArgument(f"messages[{i}].tool_call_id", "required for a tool message")


def _check_history_call(tool_call: pb.ToolCall, field: str) -> None:
    if not tool_call.id:
        raise InvalidArgument(f"{field}.id", "required")
    if not tool_call.name:
        raise InvalidArgument(f"{field}.function.name", "required")
    try:
        arguments = json.loads(tool_call.arguments_json or "{}")
    except (ValueError, RecursionError):
        raise InvalidArgument(f"{field}.function.arguments", "is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise InvalidArgument(f"{field}.function.arguments", "must be a JSON object")


# -- grammar ----------------------------------------------------------------------------------------------
def tool_spec(request: pb.GenerateRequest) -> pb.GenerateRequest | None:
    """What the grammar depends on (tools, tool_choice, parallel_tool_calls): a cache key and the
    input of `grammar_of`; None when the request gets no tool grammar."""
    if mode_of(request) is Mode.NONE:
        return None
    spec = pb.GenerateRequest(tools=request.tools, tool_choice=request.tool_choice)
    if request.HasField("parallel_tool_calls"):
        spec.parallel_tool_calls = request.parallel_tool_calls
    return spec


def lark_of(spec: pb.GenerateRequest) -> str:
    """The Lark source of a tool spec's grammar (see the module docstring)."""
    mode = mode_of(spec)
    tools = [t for t in spec.tools if mode is not Mode.NAMED or t.name == spec.tool_choice.function_name]
    one_call = mode is Mode.NAMED or (spec.HasField("parallel_tool_calls") and not spec.parallel_tool_calls)
    calls = "call" if one_call else f"call ({json.dumps(CALL_SEPARATOR)} call)*"
    rules = [
        "start: calls | TEXT" if mode is Mode.AUTO else "start: calls",
        f"TEXT: /(?s:.+)/ & ~/(?s:.*{re.escape(CALL_OPEN)}.*)/",
        f"calls: {calls}",
        f"call: {json.dumps(CALL_OPEN)} ({' | '.join(f'fn_{i}' for i in range(len(tools)))}) "
        f"{json.dumps(CALL_CLOSE)}",
    ]
    for i, tool in enumerate(tools):
        schema = {**_schema(tool), "x-guidance": _JSON_OPTIONS}
        head = json.dumps(NAME_PREFIX + tool.name + ARGUMENTS_PREFIX)
        rules.append(f"fn_{i}: {head} %json {json.dumps(schema)} \"}}\"")
    return "\n".join(rules) + "\n"


class ToolGrammarError(GrammarError):
    """A tool spec whose grammar cannot be built; `field` names the tool's parameters."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _validated(grammar: str, field: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar, None,
                                                  limits=llguidance.LLParserLimits(verbose_errors=False))
    if error:
        raise ToolGrammarError(field, error)
    return grammar


def grammar_of(spec: pb.GenerateRequest) -> str:
    """The llguidance grammar of a tool spec, checked without a vocabulary (what the gateway can do):
    each tool's schema first, so a failure names its tool.

    Raises:
        ToolGrammarError: a tool's schema cannot be compiled.
    """
    for i, tool in enumerate(spec.tools):
        field = f"tools[{i}].parameters"
        try:
            _validated(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_schema(tool))), field)
        except ValueError as e:
            raise ToolGrammarError(field, str(e)) from None
    try:
        return _validated(llguidance.LLMatcher.grammar_from_lark(lark_of(spec)), "tools")
    except ValueError as e:
        raise ToolGrammarError("tools", str(e)) from None


def compile_entry(spec: pb.GenerateRequest) -> str | GrammarError:
    """grammar_of(spec), with a failure returned rather than raised (what a cache keeps)."""
    try:
        return grammar_of(spec)
    except GrammarError as e:
        return e
