"""Structured output: `ResponseFormat` -> an llguidance grammar, shared by gateway and worker.

The gateway checks a format once at admission (`check`, cached by content) and queues the
format itself; each worker compiles the same grammar for its vocabulary (`grammar_of`) and
drives an `llguidance.LLMatcher` per sequence. llguidance was chosen for its compile time
(an order of magnitude below xgrammar's and outlines-core's; bench/grammar_libs.py,
docs/performance.md), its fast masks, and because it validates a grammar without a tokenizer,
which is what the gateway has to do.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import llguidance

from llmserve.v1 import inference_pb2 as pb

# JSON is written compactly but readably: no free whitespace (a small model can fill its whole
# budget with blank lines), ", " and ": " as separators.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = json.dumps({"type": "object"})


class GrammarError(ValueError):
    """A response_format that cannot be compiled; the message says why (for the caller)."""


def _json_schema(text: str) -> str:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError("json_schema must be a JSON object")
    return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)


def _choice(choices: list[str]) -> str:
    if not choices:
        raise GrammarError("choice needs at least one string")
    if not all(choices):
        raise GrammarError("choice strings must not be empty")
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _json_object(flag: bool) -> str:
    if not flag:
        raise GrammarError("json_object must be true when set")
    return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, overrides=_JSON_OPTIONS)


_BUILDERS = {
    "json_schema": lambda fmt: _json_schema(fmt.json_schema),
    "regex": lambda fmt: llguidance.LLMatcher.grammar_from_regex(fmt.regex),
    "choice": lambda fmt: _choice(list(fmt.choice.choices)),
    "json_object": lambda fmt: _json_object(fmt.json_object),
}


def kind_of(fmt: pb.ResponseFormat) -> str:
    """Which constraint `fmt` sets ("" = none)."""
    return fmt.WhichOneof("kind") or ""


def grammar_of(fmt: pb.ResponseFormat) -> str:
    """The llguidance grammar of a format ("" when none is set), checked.

    Raises:
        GrammarError: the schema, regex or choice list cannot be compiled.
    """
    kind = kind_of(fmt)
    if not kind:
        return ""
    try:
        grammar = _BUILDERS[kind](fmt)
    except GrammarError:
        raise
    except ValueError as e:                 # llguidance's own rejection of the input
        raise GrammarError(f"{kind}: {e}") from None
    limits = llguidance.LLParserLimits(verbose_errors=False)
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=limits)
    if error:
        raise GrammarError(f"{kind}: {error}")
    return grammar


class GrammarCache:
    """Grammar of each format content, LRU-bounded: a repeated schema is compiled once.

    Failures are cached too, so a client retrying a bad schema costs a dict lookup.
    """

    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[bytes, str | GrammarError] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, fmt: pb.ResponseFormat) -> str:
        """grammar_of(fmt), from the cache when the same content was seen. Raises GrammarError."""
        entry = self.lookup(fmt)
        if entry is None:
            entry = self.store(fmt, compile_entry(fmt))
        if isinstance(entry, GrammarError):
            raise entry
        return entry

    def lookup(self, fmt: pb.ResponseFormat) -> str | GrammarError | None:
        """The cached grammar or failure of this content (a hit), or None (compile it, then `store`)."""
        key = fmt.SerializeToString(deterministic=True)
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            self._entries.move_to_end(key)
        return entry

    def store(self, fmt: pb.ResponseFormat, entry: str | GrammarError) -> str | GrammarError:
        """Remember what compiling `fmt` gave (a miss); the oldest entry goes beyond capacity."""
        self.misses += 1
        self._entries[fmt.SerializeToString(deterministic=True)] = entry
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry


def compile_entry(fmt: pb.ResponseFormat) -> str | GrammarError:
    """grammar_of(fmt), with a failure returned rather than raised (what a cache keeps)."""
    try:
        return grammar_of(fmt)
    except GrammarError as e:
        return e
