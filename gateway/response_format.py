"""Admission check of `sampling.response_format`, in two steps that sit on either side of the quota:

    check_size(fmt, ...)              on the loop, before the quota: kind, size and choice count
    await FormatCompiler.check(...)   after the tenant's rate and concurrency admitted the request
    (.tool_grammar(...) for tools)    (the tool-call grammar, gateway/tool_calls.py, goes the same way),
                                      so the compile is charged to it (a failed one too): a compile
                                      in a worker thread (llguidance releases the GIL), bounded in
                                      time, through a content-keyed cache (a repeat costs a lookup;
                                      identical formats in flight share one compile)

A tenant sending unique 58 KB schemas therefore spends its own rate and concurrency, and never the
event loop that streams every other tenant's tokens. The gateway does not keep the compiled
grammar: the work item carries the format (or the tool grammar's text), and each worker compiles
it for its own vocabulary (llmserve/protocol/grammar.py says why).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from google.protobuf.message import Message

from gateway import metrics, tool_calls
from llmserve.protocol.grammar import GrammarCache, GrammarError, compile_entry, kind_of
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb

FIELD = "sampling.response_format"


def _format_bytes(fmt: pb.ResponseFormat) -> int:
    kind = kind_of(fmt)
    if kind == "choice":
        return sum(len(c.encode("utf-8", "surrogatepass")) for c in fmt.choice.choices)
    if kind in ("json_schema", "regex"):
        return len(getattr(fmt, kind).encode("utf-8", "surrogatepass"))
    return 0


def check_size(fmt: pb.ResponseFormat, max_bytes: int, max_choices: int) -> None:
    """InvalidArgument naming the field when `fmt` is over a size limit (no compile here)."""
    kind = kind_of(fmt)
    if kind == "choice" and len(fmt.choice.choices) > max_choices:
        raise InvalidArgument(f"{FIELD}.choice", f"at most {max_choices} choices")
    if _format_bytes(fmt) > max_bytes:
        raise InvalidArgument(f"{FIELD}.{kind}", f"exceeds {max_bytes} bytes")


class FormatCompiler:
    """Compiles response formats off the event loop, one cache for the gateway process.

    Args:
        timeout_s: longest a request waits for its compile (INVALID_ARGUMENT after it; the compile
            finishes in its thread and is cached, so a retry gets the answer at once).
        threads: compile threads (what all tenants' compiles share).
        capacity: formats remembered (LRU), failures included.
    """

    def __init__(self, timeout_s: float, threads: int = 1, capacity: int = 1024) -> None:
        self.timeout_s = timeout_s
        self.cache = GrammarCache(capacity)
        self.tool_cache = GrammarCache(capacity)
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._compiling: dict[bytes, asyncio.Future[str | GrammarError]] = {}

    async def check(self, fmt: pb.ResponseFormat, tenant: str) -> None:
        """Raises InvalidArgument naming `sampling.response_format` unless `fmt` is unset or compiles."""
        if not kind_of(fmt):
            return
        entry = self.cache.lookup(fmt)
        if entry is None:
            entry = await self._compile(self.cache, fmt, _compile_entry, tenant)
        if isinstance(entry, GrammarError):
            raise InvalidArgument(FIELD, str(entry))

    async def tool_grammar(self, request: pb.GenerateRequest, tenant: str) -> str:
        """The tool-call grammar of a request ("" when it needs none), compiled and cached like a format.

        Raises:
            InvalidArgument: naming the tool whose schema does not compile (or `tools`).
        """
        spec = tool_calls.tool_spec(request)
        if spec is None:
            return ""
        entry = self.tool_cache.lookup(spec)
        if entry is None:
            entry = await self._compile(self.tool_cache, spec, _tool_entry, tenant)
        if isinstance(entry, GrammarError):
            raise InvalidArgument(getattr(entry, "field", "tools"), str(entry))
        return entry

    async def _compile(self, cache: GrammarCache, spec: Message, build: Callable[[Message], str | GrammarError],
                       tenant: str) -> str | GrammarError:
        key = type(spec).__name__.encode() + b":" + spec.SerializeToString(deterministic=True)
        future = self._compiling.get(key)
        if future is None:
            future = self._compiling[key] = self._start(cache, spec, build, key, tenant)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.shield(future)
        except TimeoutError:
            metrics.GRAMMAR_COMPILES.labels(tenant, "timeout").inc()
            return GrammarError(f"too complex: not compiled within {self.timeout_s:g} s")

    def _start(self, cache: GrammarCache, spec: Message, build: Callable[[Message], str | GrammarError], key: bytes,
               tenant: str) -> asyncio.Future[str | GrammarError]:
        metrics.GRAMMAR_COMPILES_IN_FLIGHT.inc()
        future = asyncio.get_running_loop().run_in_executor(self.executor, build, spec)

        def done(f: asyncio.Future[str | GrammarError]) -> None:
            metrics.GRAMMAR_COMPILES_IN_FLIGHT.dec()
            del self._compiling[key]
            if f.cancelled():            # the gateway is closing
                return
            entry = cache.store(spec, f.result())
            metrics.GRAMMAR_COMPILES.labels(tenant, "invalid" if isinstance(entry, GrammarError) else "ok").inc()
        future.add_done_callback(done)
        return future

    def close(self) -> None:
        """Stop the compile threads (compiles not started are dropped)."""
        self.executor.shutdown(wait=False, cancel_futures=True)


def _compile_entry(fmt: pb.ResponseFormat) -> str | GrammarError:
    """compile_entry, in a compile thread: whatever the library raises is the format's failure."""
    try:
        return compile_entry(fmt)
    except Exception as e:  # noqa: BLE001 - a format no library can compile is the caller's 400
        return GrammarError(f"{kind_of(fmt)}: cannot be compiled ({type(e).__name__})")


def _tool_entry(spec: pb.GenerateRequest) -> str | GrammarError:
    """tool_calls.compile_entry, in a compile thread, with the same catch-all as a format's."""
    try:
        return tool_calls.compile_entry(spec)
    except Exception as e:  # noqa: BLE001 - tools no library can compile are the caller's 400
        return GrammarError(f"tools: cannot be compiled ({type(e).__name__})")
