"""Requests checked against the limits and turned into pool ops.

Every problem is an InvalidArgument naming the field (with the EncodeBatch
position, e.g. `requests[3].messages[0].role`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import tokenizer_pb2 as pb
from tokenizer_svc import protocol


@dataclass(frozen=True)
class Limits:
    max_text_bytes: int
    max_messages: int
    max_batch: int
    max_decode_ids: int


@dataclass(frozen=True)
class Op:
    """One pool op: name, arguments (hashable: also the cache key) and cost in input bytes."""

    name: str
    args: tuple[Any, ...]
    cost: int


def encode_op(request: pb.EncodeRequest, limits: Limits, prefix: str = "") -> Op:
    """The op of an EncodeRequest: text → OP_ENCODE, messages → OP_CHAT."""
    if request.messages:
        if request.text:
            raise InvalidArgument(prefix + "text", "set either text or messages, not both")
        return _chat_op(request, limits, prefix)
    size = len(request.text.encode("utf-8"))
    if size > limits.max_text_bytes:
        raise InvalidArgument(prefix + "text", f"{size} bytes; at most {limits.max_text_bytes}")
    return Op(protocol.OP_ENCODE, (request.text, request.add_special_tokens, request.allow_special_tokens), size)


def _chat_op(request: pb.EncodeRequest, limits: Limits, prefix: str) -> Op:
    count = len(request.messages)
    if count > limits.max_messages:
        raise InvalidArgument(prefix + "messages", f"{count} messages; at most {limits.max_messages}")
    size = sum(t.ByteSize() for t in request.tools)
    for i, message in enumerate(request.messages):
        if not message.role:
            raise InvalidArgument(f"{prefix}messages[{i}].role", "must not be empty")
        size += len(message.role.encode("utf-8")) + len(message.content.encode("utf-8"))
        size += sum(c.ByteSize() for c in message.tool_calls) + len(message.tool_call_id)
    if size > limits.max_text_bytes:
        raise InvalidArgument(prefix + "messages", f"{size} bytes of content; at most {limits.max_text_bytes}")
    add_generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
    messages = tuple(_message_row(m) for m in request.messages)
    tools = tuple((t.name, t.description, t.parameters_json_schema) for t in request.tools)
    return Op(protocol.OP_CHAT, (messages, add_generation_prompt, *((tools,) if tools else ())), size)


def _message_row(m) -> tuple:
    """A message as protocol.OP_CHAT carries it: (role, content), plus its tool fields where it has any."""
    if not m.tool_calls and not m.tool_call_id:
        return (m.role, m.content)
    return (m.role, m.content, tuple((c.id, c.name, c.arguments_json) for c in m.tool_calls), m.tool_call_id)


def batch_size(request: pb.EncodeBatchRequest, limits: Limits) -> int:
    count = len(request.requests)
    if count > limits.max_batch:
        raise InvalidArgument("requests", f"{count} requests; at most {limits.max_batch}")
    return count


def decode_op(request: pb.DecodeRequest, limits: Limits, vocab_size: int) -> Op:
    count = len(request.token_ids)
    if count > limits.max_decode_ids:
        raise InvalidArgument("token_ids", f"{count} ids; at most {limits.max_decode_ids}")
    ids = array("I", request.token_ids)
    if ids and max(ids) >= vocab_size:
        raise InvalidArgument("token_ids", f"id {max(ids)} is outside the vocabulary (size {vocab_size})")
    return Op(protocol.OP_DECODE, (ids, request.skip_special_tokens), 4 * count)
