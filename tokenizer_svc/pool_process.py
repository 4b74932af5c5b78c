"""One pool process: every configured model's tokenizer, and one thread per lane.

    socket ─▶ main thread (reads Tasks) ─┬─▶ interactive lane thread ─┐
                                         └─▶ bulk lane thread ────────┴─▶ socket (Results, under a lock)

`tokenizers` releases the GIL while it encodes, so a short request on the
interactive lane runs while an 8k-token document is being encoded on the bulk
lane of the same process: no head-of-line blocking even with one process.
Runs under the "spawn" start method, so nothing of the front's gRPC/asyncio
state is inherited.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

from tokenizer_svc import protocol
from tokenizer_svc.chat_template import ChatTemplateError
from tokenizer_svc.loader import ModelTokenizer
from tokenizer_svc.protocol import Result, Task
from tokenizer_svc.segments import SegmentEncoder


class PoolProcess:
    """Executes Tasks against the loaded models."""

    def __init__(self, sock: socket.socket, models: dict[str, ModelTokenizer], segment_cache_bytes: int) -> None:
        self.sock = sock
        self.models = models
        self.segments = {name: SegmentEncoder(m, segment_cache_bytes) for name, m in models.items()}
        self.send_lock = threading.Lock()
        self.lanes: dict[int, queue.SimpleQueue[Task | None]] = {lane: queue.SimpleQueue() for lane in protocol.LANES}
        self.ops: dict[str, Callable[[Task], Any]] = {
            protocol.OP_ENCODE: self._encode, protocol.OP_CHAT: self._chat, protocol.OP_DECODE: self._decode,
        }

    def run(self) -> None:
        threads = [threading.Thread(target=self._lane, args=(q,), daemon=True) for q in self.lanes.values()]
        for thread in threads:
            thread.start()
        self._send(protocol.Ready(os.getpid()))
        while (task := protocol.recv_message(self.sock)) is not None:
            self.lanes[task.lane].put(task)
        for q in self.lanes.values():  # front closed the socket: finish queued work, then exit
            q.put(None)
        for thread in threads:
            thread.join()

    def _lane(self, tasks: queue.SimpleQueue[Task | None]) -> None:
        while (task := tasks.get()) is not None:
            try:
                self._send(self._execute(task))
            except OSError:
                return  # front is gone

    def _execute(self, task: Task) -> Result:
        if task.deadline is not None and time.monotonic() >= task.deadline:
            return Result(task.job_id, error=(protocol.ERR_DEADLINE, "", "deadline exceeded before encoding"))
        segments = self.segments[task.model].cache
        hits, misses = segments.hits, segments.misses
        try:
            value = self.ops[task.op](task)
        except ChatTemplateError as exc:
            return Result(task.job_id, error=(protocol.ERR_INVALID, "messages", str(exc)))
        except Exception as exc:  # noqa: BLE001 - reported to the front, which logs it with the task
            return Result(task.job_id, error=(protocol.ERR_INTERNAL, "", repr(exc)))
        # Counter deltas are approximate when both lanes hit the same model at once; they only feed metrics.
        return Result(task.job_id, value=value, cache_hits=segments.hits - hits, cache_misses=segments.misses - misses)

    def _encode(self, task: Task) -> array:
        text, add_special_tokens, allow_special_tokens = task.args
        return array("I", self.models[task.model].encode(text, add_special_tokens=add_special_tokens,
                                                         special_tokens_as_text=not allow_special_tokens))

    def _chat(self, task: Task) -> array:
        messages, add_generation_prompt, *tools = task.args
        conversation = [_message(*m) for m in messages]
        return array("I", self.models[task.model].encode_chat(conversation, add_generation_prompt,
                                                              encode_prompt=self.segments[task.model].encode,
                                                              tools=tools[0] if tools else ()))

    def _decode(self, task: Task) -> str:
        ids, skip_special_tokens = task.args
        return self.models[task.model].decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _send(self, message: Any) -> None:
        frame = protocol.pack(message)
        with self.send_lock:
            self.sock.sendall(frame)


def _message(role: str, content: str, tool_calls: tuple = (), tool_call_id: str = "") -> dict[str, Any]:
    """A message dict from its protocol.OP_CHAT row (the tool fields only where a message has them)."""
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if tool_call_id:
        message["tool_call_id"] = tool_call_id
    return message


def main(sock: socket.socket, models: dict[str, ModelTokenizer], segment_cache_bytes: int) -> None:
    """Entry point of a spawned pool process."""
    # Parallelism comes from the pool and its lanes; rayon threads per process would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        PoolProcess(sock, models, segment_cache_bytes).run()
    except (OSError, KeyboardInterrupt):
        pass
