"""What the Python client returns: plain dataclasses made from the gateway's protobuf replies.

    GenerateResponse ─ to_chunk ──────▶ Chunk        (one streamed piece of one choice)
    CompleteResponse ─ to_completion ─▶ Completion   (choice 0 on top, every choice in `choices`)

Tool calls come whole (`ToolCall.arguments` is JSON text that parses and validates against the
tool's schema); `Choice.as_message()` is the assistant turn to put back into the conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmserve.v1 import inference_pb2 as pb

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    queue_ms: float
    ttft_ms: float
    total_ms: float

    @classmethod
    def from_pb(cls, u: pb.Usage) -> Usage:
        return cls(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens, u.queue_ms, u.ttft_ms, u.total_ms)


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made; `arguments` is its JSON text."""

    id: str
    name: str
    arguments: str

    @classmethod
    def from_pb(cls, call: pb.ToolCall) -> ToolCall:
        return cls(call.id, call.name, call.arguments_json)

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)

    def as_openai(self) -> dict:
        """OpenAI's shape of the call, as an assistant message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The log probability of one completion token, and its `top` alternatives (most likely first)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()

    @classmethod
    def from_pb(cls, lp: pb.TokenLogprob) -> TokenLogprob:
        return cls(lp.token_id, lp.token, lp.logprob, tuple(TopLogprob(t.token_id, t.token, t.logprob) for t in lp.top))


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of choice `choice_index`; `finish_reason` ("stop" | "length" | "cancelled" |
    "tool_calls") on the choice's last chunk, `usage` (of the whole request) on the stream's last."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    index: int
    finish_reason: str | None = None
    usage: Usage | None = None
    choice_index: int = 0
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Choice:
    """One of the n choices of a completion."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()

    def as_message(self) -> dict:
        """This choice as the assistant turn of a conversation (what `messages` takes back)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [c.as_openai() for c in self.tool_calls]
        return message


@dataclass(frozen=True)
class Completion:
    """A whole completion: choice 0's fields on top, every choice in `choices`."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    choices: tuple[Choice, ...] = ()

    def as_message(self) -> dict:
        """Choice 0 as the assistant turn of a conversation."""
        return self.choices[0].as_message()


def _calls(calls) -> tuple[ToolCall, ...]:
    return tuple(ToolCall.from_pb(c) for c in calls)


def _logprobs(lps) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob.from_pb(lp) for lp in lps)


def to_chunk(resp: pb.GenerateResponse) -> Chunk:
    return Chunk(resp.request_id, resp.text, tuple(resp.token_ids), resp.index,
                 FINISH_REASONS.get(resp.finish_reason), Usage.from_pb(resp.usage) if resp.HasField("usage") else None,
                 resp.choice_index, _calls(resp.tool_calls), _logprobs(resp.logprobs))


def _choice(c: pb.CompleteChoice) -> Choice:
    return Choice(c.choice_index, c.text, tuple(c.token_ids), FINISH_REASONS.get(c.finish_reason),
                  _calls(c.tool_calls), _logprobs(c.logprobs))


def to_completion(reply: pb.CompleteResponse) -> Completion:
    choices = tuple(_choice(c) for c in reply.choices) or (Choice(
        0, reply.text, tuple(reply.token_ids), FINISH_REASONS.get(reply.finish_reason),
        _calls(reply.tool_calls), _logprobs(reply.logprobs)),)
    first = choices[0]
    return Completion(reply.request_id, first.text, first.token_ids, first.finish_reason, Usage.from_pb(reply.usage),
                      first.tool_calls, first.logprobs, choices)
