"""Tools and tool turns into a conversation for the model's chat template.

A template that reads a `tools` variable has its own tool syntax: it gets what Hugging Face's
`apply_chat_template(tools=...)` gives it (the tools as `{"type": "function", "function": {...}}`,
assistant `tool_calls` with parsed `arguments`, tool turns with `tool_call_id`). A template
without one (SmolLM2's ignores `tools` and knows no tool role) gets the fallback of docs/tools.md,
written in plain message contents, so the chat template renders it as any text:

    system     its content + "\\n\\n" + the tool list and the call format (a system turn is added
               when the conversation has none)
    assistant  its content, then one `<tool_call>{"name": ..., "arguments": ...}</tool_call>` per call
    tool       a user turn `<tool_response>\\n...\\n</tool_response>`

The call format is the one the gateway's grammar makes every model write (gateway/tool_calls.py).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta

Messages = list[dict[str, Any]]
# (name, description, parameters JSON schema text) of each tool; (id, name, arguments JSON) of each call
ToolRow = tuple[str, str, str]
CallRow = tuple[str, str, str]

_FALLBACK_HEAD = ("# Tools\n\nYou may call one or more of these functions. Their signatures, as JSON "
                  "schemas of their arguments:\n")
_FALLBACK_TAIL = ("\nTo call functions, reply with the calls only, one per line, each as\n"
                  '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>\n'
                  "A function's result comes back in <tool_response></tool_response>.")


@lru_cache(maxsize=32)
def knows_tools(source: str) -> bool:
    """Whether a chat template has its own tool syntax (it reads the `tools` variable)."""
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateSyntaxError:
        return False     # chat_template.compile_template says why when it renders


def _arguments(text: str) -> dict[str, Any]:
    return json.loads(text) if text else {}


def _tool_defs(tools: tuple[ToolRow, ...]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name, "description": description,
                                              "parameters": json.loads(schema) if schema else {"type": "object"}}}
            for name, description, schema in tools]


def _native(messages: Messages) -> Messages:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": _arguments(a)}}
                               for i, n, a in m["tool_calls"]]
        else:
            m.pop("tool_calls", None)
        if not m.get("tool_call_id"):
            m.pop("tool_call_id", None)
        out.append(m)
    return out


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (the grammar's format)."""
    body = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


def _fallback_message(m: dict[str, Any]) -> dict[str, Any]:
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    calls = [call_text(name, arguments) for _, name, arguments in m.get("tool_calls", ())]
    content = "\n".join(([m["content"]] if m["content"] else []) + calls)
    return {"role": m["role"], "content": content}


def _fallback(messages: Messages, tools: tuple[ToolRow, ...]) -> Messages:
    out = [_fallback_message(m) for m in messages]
    if not tools:
        return out
    listing = "\n".join(json.dumps(d["function"], ensure_ascii=False) for d in _tool_defs(tools))
    text = _FALLBACK_HEAD + listing + _FALLBACK_TAIL
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + text}, *out[1:]]
    return [{"role": "system", "content": text}, *out]


def prepare(source: str, messages: Messages, tools: tuple[ToolRow, ...]) -> tuple[Messages, list | None]:
    """The messages to render, and the template's `tools` variable (None: not given to the template).

    Args:
        source: the chat template.
        messages: [{"role", "content", "tool_calls": ((id, name, arguments), ...), "tool_call_id"}, ...].
        tools: the request's tools.
    """
    if knows_tools(source):
        return _native(messages), (_tool_defs(tools) if tools else None)
    return _fallback(messages, tools), None


def uses_tools(messages: Messages, tools: tuple[ToolRow, ...]) -> bool:
    """Whether a conversation needs `prepare` (tools, tool calls or tool turns in it)."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
