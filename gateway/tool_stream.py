"""The model's tool-call text (gateway/tool_calls.py's format) parsed as it streams, and the chunks
rewritten: calls leave `text` and come as ToolCalls; OpenAI's streamed `tool_calls` deltas beside.

    text:   <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\\n<tool_call>...
    states: OPEN ───────────── NAME ─ ARGUMENTS_PREFIX ─ ARGS ──── CLOSE ── SEPARATOR ─ OPEN ...
    events:                        CallStarted(0, id, "f")  ArgumentsDelta*  CallDone(ToolCall)

In auto mode the first characters decide: text that starts with `<tool_call>` is calls, anything else
is content (the grammar never lets content contain `<tool_call>`), so a prefix of it is held back
until it is decided. The grammar guarantees the shape, so the parser only follows it; call ids are
derived from the request id and the call's position, identical on every resume and re-run.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from gateway.tool_calls import (
    ARGUMENTS_PREFIX,
    CALL_CLOSE,
    CALL_OPEN,
    CALL_SEPARATOR,
    NAME_PREFIX,
    Mode,
    mode_of,
)
from llmserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.request_state import Call

_HEAD = CALL_OPEN + NAME_PREFIX
_TAIL = "}" + CALL_CLOSE


class _State(Enum):
    DECIDING = "deciding"    # auto: text or calls, not known yet
    TEXT = "text"            # content to the end
    OPEN = "open"            # expecting `<tool_call>{"name": "`
    NAME = "name"
    ARGS = "args"            # inside the arguments JSON
    CLOSE = "close"          # expecting `}</tool_call>`
    SEPARATOR = "separator"  # after a call: the next one, or the end


@dataclass(frozen=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = str | CallStarted | ArgumentsDelta | pb.ToolCall   # str: content text; ToolCall: a call done


def call_id(request_id: str, index: int) -> str:
    """`call_` + 24 hex digits, a function of the request and the call's position."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


class _Arguments:
    """Where a JSON value ends: depth outside strings, string and escape state inside them."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def end_of(self, text: str) -> int:
        """Length of `text` that belongs to the value (len(text) when it has not ended yet)."""
        for i, char in enumerate(text):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(text)


class ToolCallParser:
    """Feed completion text in order; get content text and call events."""

    def __init__(self, mode: Mode, request_id: str) -> None:
        self.state = _State.DECIDING if mode is Mode.AUTO else _State.OPEN
        self.request_id = request_id
        self.pending = ""
        self.calls: list[pb.ToolCall] = []       # finished calls, in order
        self._name = ""
        self._args: list[str] = []
        self._scanner = _Arguments()

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while self.pending and self._step(events):
            pass
        return events

    def flush(self) -> list[Event]:
        """At the end of the completion: undecided text is content; a call cut short is dropped."""
        if self.state is _State.DECIDING and self.pending:
            self.state = _State.TEXT
            return self.feed("")
        return []

    def _step(self, events: list[Event]) -> bool:
        """Consume what the current state can from `pending`; False when it needs more text."""
        return _STEPS[self.state](self, events)

    def _decide(self, events: list[Event]) -> bool:
        if self.pending.startswith(CALL_OPEN):
            self.state = _State.OPEN
        elif not CALL_OPEN.startswith(self.pending):
            self.state = _State.TEXT
        return self.state is not _State.DECIDING

    def _text(self, events: list[Event]) -> bool:
        events.append(self.pending)
        self.pending = ""
        return False

    def _literal(self, literal: str, then: _State) -> bool:
        if len(self.pending) < len(literal):
            return False
        if not self.pending.startswith(literal):   # not the grammar's output: stop parsing
            self.state, self.pending = _State.TEXT, ""
            return False
        self.pending = self.pending[len(literal):]
        self.state = then
        return True

    def _open(self, events: list[Event]) -> bool:
        return self._literal(_HEAD, _State.NAME)

    def _name_step(self, events: list[Event]) -> bool:
        end = self.pending.find('"')
        if end < 0 or len(self.pending) < end + len(ARGUMENTS_PREFIX):
            return False
        self._name = self.pending[:end]
        self.pending = self.pending[end:]
        if not self._literal(ARGUMENTS_PREFIX, _State.ARGS):
            return False
        events.append(CallStarted(len(self.calls), call_id(self.request_id, len(self.calls)), self._name))
        self._args, self._scanner = [], _Arguments()
        return True

    def _arguments(self, events: list[Event]) -> bool:
        end = self._scanner.end_of(self.pending)
        piece, self.pending = self.pending[:end], self.pending[end:]
        self._args.append(piece)
        events.append(ArgumentsDelta(len(self.calls), piece))
        if self._scanner.depth == 0:
            self.state = _State.CLOSE
        return bool(self.pending)

    def _close(self, events: list[Event]) -> bool:
        if not self._literal(_TAIL, _State.SEPARATOR):
            return False
        index = len(self.calls)
        call = pb.ToolCall(id=call_id(self.request_id, index), name=self._name, arguments_json="".join(self._args))
        self.calls.append(call)
        events.append(call)
        return True

    def _separator(self, events: list[Event]) -> bool:
        return self._literal(CALL_SEPARATOR, _State.OPEN)


_STEPS = {
    _State.DECIDING: ToolCallParser._decide, _State.TEXT: ToolCallParser._text,
    _State.OPEN: ToolCallParser._open, _State.NAME: ToolCallParser._name_step,
    _State.ARGS: ToolCallParser._arguments, _State.CLOSE: ToolCallParser._close,
    _State.SEPARATOR: ToolCallParser._separator,
}


class ToolCallStream:
    """Rewrites the chunks of one request with tools: content in `text`, finished calls in
    `tool_calls`, and finish_reason TOOL_CALLS when the turn ended on its calls.

    Args:
        mode: the request's tool mode (not NONE).
        request_id: the request's id (call ids derive from it).
    """

    def __init__(self, mode: Mode, request_id: str) -> None:
        self.mode, self.request_id = mode, request_id
        self.parsers: dict[int, ToolCallParser] = {}   # by choice (n > 1: each choice its own calls)

    def _parser(self, choice: int) -> ToolCallParser:
        if choice not in self.parsers:
            ids_from = self.request_id if choice == 0 else f"{self.request_id}#{choice}"
            self.parsers[choice] = ToolCallParser(self.mode, ids_from)
        return self.parsers[choice]

    def feed(self, chunk: pb.GenerateResponse) -> tuple[pb.GenerateResponse, list[dict]]:
        """The chunk to send, and the OpenAI `delta.tool_calls` entries of the same text."""
        parser = self._parser(chunk.choice_index)
        events = parser.feed(chunk.text)
        if chunk.finish_reason:
            events += parser.flush()
        out = pb.GenerateResponse()
        out.CopyFrom(chunk)
        out.text = "".join(e for e in events if isinstance(e, str))
        out.tool_calls.extend(e for e in events if isinstance(e, pb.ToolCall))
        if chunk.finish_reason == pb.FINISH_REASON_STOP and parser.state is _State.SEPARATOR:
            out.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        return out, openai_deltas(events)


def openai_deltas(events: list[Event]) -> list[dict]:
    """OpenAI's `delta.tool_calls`: per call, index + id + type + name first, then argument fragments
    (one entry per call and chunk)."""
    deltas: dict[int, dict] = {}
    for event in events:
        if isinstance(event, CallStarted):
            deltas[event.index] = {"index": event.index, "id": event.id, "type": "function",
                                   "function": {"name": event.name, "arguments": ""}}
        elif isinstance(event, ArgumentsDelta):
            entry = deltas.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += event.text
    return list(deltas.values())


def stream_for(request: pb.GenerateRequest, request_id: str) -> ToolCallStream | None:
    """The rewriter of a request's chunks; None when it has no tool grammar (tool_choice none, no tools)."""
    mode = mode_of(request)
    return None if mode is Mode.NONE else ToolCallStream(mode, request_id)


async def rewrite(gateway: Gateway, call: Call, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
    """The request's chunks with tool calls parsed out (as they are without tools): what gRPC sends.

    A resume (x-resume-from) of a request with tools reads the stream from its start, since the
    parser needs the calls from their first character, and drops the chunks before the resume
    point after parsing them: chunks are cut at the same places on every read (gateway/output.py),
    and a call is sent in the chunk where it completes, so the client gets each call exactly once.
    """
    stream = stream_for(request, call.request_id)
    resume_from = call.resume_from
    if stream is not None:
        call.resume_from = 0
    async for chunk in gateway.generate(call, request):
        if stream is not None:
            chunk = stream.feed(chunk)[0]
        if chunk.index >= resume_from:
            yield chunk
