"""Admission check of `sampling.response_format`: size limits, then a compile through the
content-keyed cache (llmserve.grammar), so a repeated schema costs one dict lookup.

The gateway does not keep the compiled grammar: the work item carries the format, and each
worker compiles it for its own vocabulary (llmserve/grammar.py says why).
"""

from __future__ import annotations

from llmserve.errors import InvalidArgument
from llmserve.grammar import GrammarCache, GrammarError, kind_of
from llmserve.v1 import inference_pb2 as pb

FIELD = "sampling.response_format"

# One per gateway process: grammars are pure functions of the format's bytes, so sharing the
# cache between concurrent requests shares no request state.
_CACHE = GrammarCache(capacity=1024)


def _format_bytes(fmt: pb.ResponseFormat) -> int:
    kind = kind_of(fmt)
    if kind == "choice":
        return sum(len(c.encode("utf-8", "surrogatepass")) for c in fmt.choice.choices)
    if kind in ("json_schema", "regex"):
        return len(getattr(fmt, kind).encode("utf-8", "surrogatepass"))
    return 0


def check_response_format(fmt: pb.ResponseFormat, max_bytes: int, max_choices: int) -> None:
    """Raises InvalidArgument naming `sampling.response_format` unless `fmt` is unset or compiles."""
    kind = kind_of(fmt)
    if not kind:
        return
    if kind == "choice" and len(fmt.choice.choices) > max_choices:
        raise InvalidArgument(f"{FIELD}.choice", f"at most {max_choices} choices")
    if _format_bytes(fmt) > max_bytes:
        raise InvalidArgument(f"{FIELD}.{kind}", f"exceeds {max_bytes} bytes")
    try:
        _CACHE.get(fmt)
    except GrammarError as e:
        raise InvalidArgument(FIELD, str(e)) from None


def cache_stats() -> tuple[int, int]:
    """(hits, misses) of the admission cache."""
    return _CACHE.hits, _CACHE.misses
