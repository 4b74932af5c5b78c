"""Concurrent seeded streams through the client SDK, recorded chunk by chunk (for the fault tests).

    load = StreamLoad(target, "dev-key", prompts=PROMPTS[:16], max_new_tokens=24)
    baseline = load.run()                                # fault-free
    running = load.start(tag="kill")                     # the same requests again, in the background
    running.wait_started(8)                              # ...until 8 streams have tokens
    stack.kill("gpu_worker-0")
    fault_at = time.monotonic()
    records = running.join()
    assert [r.token_ids for r in records] == [r.token_ids for r in baseline]
    assert all(r.contiguous() for r in records)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from llmserve.client import Client, LLMServeError, RetryPolicy

PROMPTS = (
    "What is the capital of France?", "Name three colors.", "What is 2+2?", "Say hello in Spanish.",
    "What is the largest planet?", "Who wrote Hamlet?", "What is water made of?", "Count from one to five.",
    "Name a fruit that is yellow.", "What do bees make?", "How many legs does a spider have?",
    "What is the opposite of hot?", "Name a day of the week.", "What color is the sky?",
    "What animal says moo?", "What is frozen water called?", "Name a musical instrument.",
    "What is the first letter of the alphabet?", "How many days are in a week?", "What do plants need to grow?",
    "Name a shape with three sides.", "What is the boiling point of water?", "Who was Albert Einstein?",
    "What is the sun?", "Name a bird that cannot fly.", "What is a noun?", "Give me a synonym for happy.",
    "What is the capital of Japan?", "Name an ocean.", "What does a thermometer measure?",
    "Translate 'thank you' to French.", "What is the square root of 16?",
)


@dataclass
class StreamRecord:
    """What one request delivered to the caller through the SDK."""

    prompt: str
    request_id: str
    start_s: float
    chunk_indices: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None          # status name when the SDK gave up
    end_s: float = 0.0

    def contiguous(self) -> bool:
        """Every index exactly once: each chunk starts where the previous one ended, from 0."""
        expected = 0
        for index, count in zip(self.chunk_indices, self.chunk_tokens):
            if index != expected:
                return False
            expected += count
        return expected == len(self.token_ids)

    def largest_gap_after(self, t: float) -> float | None:
        """Longest wait for a chunk across time t (None if the stream had ended before t)."""
        times = [self.start_s, *self.chunk_times_s]
        if times[-1] < t:
            return None
        gaps = [b - a for a, b in zip(times, times[1:]) if b >= t]
        return max(gaps) if gaps else None


class RunningLoad:
    """Streams in flight on background threads."""

    def __init__(self, futures: list[Future], records: list[StreamRecord], started: threading.Semaphore,
                 pool: ThreadPoolExecutor) -> None:
        self.futures, self.records, self._started, self._pool = futures, records, started, pool

    def wait_started(self, count: int, timeout_s: float = 300.0) -> None:
        """Block until `count` streams have received their first tokens."""
        deadline = time.monotonic() + timeout_s
        for _ in range(count):
            if not self._started.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"fewer than {count} streams started")

    def join(self, timeout_s: float = 600.0) -> list[StreamRecord]:
        for future in self.futures:
            future.result(timeout=timeout_s)
        self._pool.shutdown()
        return self.records


class StreamLoad:
    """len(prompts) concurrent seeded, bounded streams through `Client.generate` (greedy unless a
    temperature is given: with the seed, sampled output is reproducible too)."""

    def __init__(self, target: str, api_key: str, prompts=PROMPTS[:16], max_new_tokens: int = 24,
                 timeout_s: float = 180.0, retry: RetryPolicy | None = None, temperature: float = 0.0,
                 response_format=None) -> None:
        self.target, self.api_key, self.prompts = target, api_key, list(prompts)
        self.response_format = response_format   # pb.ResponseFormat of every stream (None: free text)
        self.max_new_tokens, self.timeout_s, self.temperature = max_new_tokens, timeout_s, temperature
        self.retry = retry or RetryPolicy(max_attempts=40, initial_s=0.05, max_backoff_s=1.0)

    def _one(self, client: Client, record: StreamRecord, started: threading.Semaphore) -> None:
        try:
            for chunk in client.generate(messages=[{"role": "user", "content": record.prompt}],
                                         timeout=self.timeout_s, max_new_tokens=self.max_new_tokens,
                                         temperature=self.temperature, seed=1234, request_id=record.request_id,
                                         response_format=self.response_format):
                if not record.chunk_times_s:
                    started.release()
                record.chunk_times_s.append(time.monotonic())
                record.chunk_indices.append(chunk.index)
                record.chunk_tokens.append(len(chunk.token_ids))
                record.token_ids.extend(chunk.token_ids)
                record.text += chunk.text
                record.finish_reason = chunk.finish_reason or record.finish_reason
        except LLMServeError as exc:
            record.error = exc.code.name
        finally:
            record.end_s = time.monotonic()

    def start(self, tag: str = "run") -> RunningLoad:
        client = Client(self.target, api_key=self.api_key, retry=self.retry)
        started = threading.Semaphore(0)
        now = time.monotonic()
        records = [StreamRecord(prompt=p, request_id=f"{tag}-{i}-{int(now * 1000)}", start_s=now)
                   for i, p in enumerate(self.prompts)]
        pool = ThreadPoolExecutor(len(records))
        futures = [pool.submit(self._one, client, r, started) for r in records]
        return RunningLoad(futures, records, started, pool)

    def run(self, tag: str = "baseline") -> list[StreamRecord]:
        return self.start(tag).join()


def mismatches(records: list[StreamRecord], baseline: list[StreamRecord]) -> list[str]:
    """Every way `records` differ from a fault-free baseline of the same prompts (empty = identical)."""
    out = []
    for got, want in zip(records, baseline):
        if got.error:
            out.append(f"{got.request_id}: failed {got.error}")
        elif got.token_ids != want.token_ids or got.text != want.text:
            out.append(f"{got.request_id}: output differs from the fault-free run ({len(got.token_ids)} vs "
                       f"{len(want.token_ids)} tokens, finish {got.finish_reason}, text {got.text[:40]!r})")
        elif not got.contiguous():
            out.append(f"{got.request_id}: indices not contiguous {got.chunk_indices}")
        elif got.finish_reason not in ("stop", "length"):
            out.append(f"{got.request_id}: finish_reason {got.finish_reason}")
    return out


def stall_s(records: list[StreamRecord], fault_at: float) -> float | None:
    """The longest any stream waited for its next chunk across the fault: the recovery time seen by clients."""
    gaps = [g for r in records if (g := r.largest_gap_after(fault_at)) is not None]
    return max(gaps) if gaps else None
