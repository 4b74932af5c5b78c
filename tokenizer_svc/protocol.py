"""The wire between the gRPC front and its pool processes: length-prefixed pickle frames
over a Unix socket pair.

    front ─▶ process   Task(job_id, op, model, args, lane, deadline)
    process ─▶ front   Ready(pid) once, then Result(job_id, ok, value, error, cache_hits, cache_misses)

`deadline` is `time.monotonic()` seconds: CLOCK_MONOTONIC is one clock for every
process of the machine, so the pool process can drop a task whose caller gave up.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("!I")

# Ops a pool process runs: name → (args).
OP_ENCODE = "encode"   # (text: str, add_special_tokens: bool, allow_special_tokens: bool) → array('I')
OP_CHAT = "chat"       # (messages: tuple[tuple[str, str], ...], add_generation_prompt: bool) → array('I')
                       # with tools: a third arg, tuple[(name, description, schema)], and messages that
                       # carry them are (role, content, ((id, name, arguments), ...), tool_call_id)
                       # special tokens spelled in messages (or, unless allowed, in text) stay text
OP_DECODE = "decode"   # (ids: array('I'), skip_special_tokens: bool) → str

LANE_INTERACTIVE = 0   # short inputs: never queued behind a long document
LANE_BULK = 1          # long inputs
LANES = (LANE_INTERACTIVE, LANE_BULK)

# Error kinds in Result.error: (kind, field, message).
ERR_INVALID = "invalid"
ERR_DEADLINE = "deadline"
ERR_INTERNAL = "internal"


@dataclass(frozen=True)
class Task:
    job_id: int
    op: str
    model: str
    args: tuple[Any, ...]
    lane: int
    deadline: float | None


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Result:
    job_id: int
    value: Any = None
    error: tuple[str, str, str] | None = None
    cache_hits: int = 0
    cache_misses: int = 0


def pack(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> Any:
    return pickle.loads(body)


def recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes from a blocking socket, or None at EOF."""
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> Any | None:
    """The next message from a blocking socket, or None at EOF."""
    header = recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    body = recv_exactly(sock, HEADER.unpack(header)[0])
    return None if body is None else unpack(body)
