"""Grammar libraries on SmolLM2's 49k vocabulary: schema compile time and token-mask time.

    .venv/bin/pip install xgrammar==0.2.9 outlines-core==0.2.14   # the two not chosen (llguidance is a dependency)
    .venv/bin/python bench/grammar_libs.py [--model PATH] [--repeat 3]

For llguidance, xgrammar and outlines-core, on this CPU, with the real SmolLM2 tokenizer:
  * compile ms: from a JSON schema (and a regex) to something that can compute masks for
    this vocabulary (per-library caches cleared, best of --repeat);
  * mask us/token: walk the tokens of one valid document, computing the full-vocabulary
    mask before every token and then consuming it (the work of one constrained decode step).
The tokenizer-side setup (vocabulary import) is printed apart: it is paid once per worker.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "admin",
                       "address": {"city": "London", "zip": "W1"}, "tags": ["math", "engines"],
                       "score": 9.5, "active": True}, separators=(",", ":"))
REGEX = r"[A-Z][a-z]{2,8}-[0-9]{3,5}-[a-z]{2,6}"
REGEX_TEXT = "Hello-12345-world"


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return min(times)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        import llguidance
        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)

    def compile_schema(self):
        grammar = self.llg.grammar_from("json_schema", json.dumps(SCHEMA))
        matcher = self.llg.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def compile_regex(self):
        return self.llg.LLMatcher(self.tok, self.llg.grammar_from("regex", REGEX))

    def walk(self, matcher, tokens: list[int]) -> None:
        for t in tokens:
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
            assert bits[t // 32] >> (t % 32) & 1, "token not allowed"
            assert matcher.consume_token(t)


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[bytes], eos: int) -> None:
        import xgrammar
        self.xg = xgrammar
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, self.info.vocab_size)

    def compile_schema(self):
        return self.xg.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                          separators=(",", ":")))

    def compile_regex(self):
        return self.xg.GrammarMatcher(self.compiler.compile_regex(REGEX))

    def walk(self, matcher, tokens: list[int]) -> None:
        for t in tokens:
            matcher.fill_next_token_bitmask(self.bitmask)
            assert matcher.accept_token(t), "token not allowed"


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: list[bytes], eos: int) -> None:
        import outlines_core
        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if i != eos and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, by_bytes)
        self.mask = np.zeros((len(vocab) + 31) // 32, dtype=np.uint32)

    def compile_schema(self):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def compile_regex(self):
        return self.oc.Guide(self.oc.Index(REGEX, self.vocab))

    def walk(self, guide, tokens: list[int]) -> None:
        for t in tokens:
            guide.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)
            assert self.mask[t // 32] >> (t % 32) & 1, "token not allowed"
            guide.advance(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF or HF dir (default: the fetched SmolLM2)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from llmserve.catalog import model_store
    from tokenizer_svc.loader import load_tokenizer

    tokenizer = load_tokenizer(args.model or model_store.fetch())
    eos = tokenizer.eos_token_ids[0]
    start = time.perf_counter()
    libs: list = [LLGuidance(tokenizer.to_json(), eos)]
    setup = {"llguidance": (time.perf_counter() - start) * 1000}
    vocab = [libs[0].tok.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
    for cls in (XGrammar, OutlinesCore):
        start = time.perf_counter()
        libs.append(cls(vocab, eos))
        setup[cls.name] = (time.perf_counter() - start) * 1000
    doc_tokens = tokenizer.encode(DOCUMENT)
    regex_tokens = tokenizer.encode(REGEX_TEXT)
    print(f"vocab {tokenizer.vocab_size}, document {len(doc_tokens)} tokens, regex text {len(regex_tokens)} tokens")
    print(f"{'library':<14}{'vocab setup ms':>15}{'schema ms':>11}{'regex ms':>10}{'schema mask us/tok':>20}"
          f"{'regex mask us/tok':>19}")
    for lib in libs:
        schema_ms = best_ms(lib.compile_schema, args.repeat)
        regex_ms = best_ms(lib.compile_regex, args.repeat)
        masks = []
        for compile_fn, tokens in ((lib.compile_schema, doc_tokens), (lib.compile_regex, regex_tokens)):
            matchers = [compile_fn() for _ in range(args.repeat)]
            walks = [best_ms(lambda m=m, lib=lib, tokens=tokens: lib.walk(m, tokens), 1) for m in matchers]
            masks.append(min(walks) * 1000 / len(tokens))
        print(f"{lib.name:<14}{setup[lib.name]:>15.0f}{schema_ms:>11.1f}{regex_ms:>10.1f}{masks[0]:>20.0f}"
              f"{masks[1]:>19.0f}")


if __name__ == "__main__":
    main()
