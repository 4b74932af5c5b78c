"""Chat prompts encoded segment by segment, with the segments cached.

A rendered chat prompt is text cut by special tokens:

    <|im_start|>│system\\nYou are ... (2 KB)│<|im_end|>│\\n│<|im_start|>│user\\nHi│<|im_end|>│\\n│<|im_start|>│assistant\\n
                └──── segment (cached) ────┘          └┘             └─ new ─┘          └┘             └─ cached ─┘

`tokenizers` splits added tokens out first and encodes the text between them
independently, so encode(prompt) == the concatenation of each segment's ids and
the special tokens' ids. The system prompt and earlier turns of a conversation
(resent every turn) are then looked up instead of re-tokenized, for several
times less CPU the longer they are (bench/tokenizer_pool.py, "segment cache"
section; docs/performance.md). Only special tokens without
lstrip/rstrip are cut points (stripping would reach across a cut), and because the
identity is a property of the tokenizer, SegmentEncoder checks it per model on probe
conversations at start-up and falls back to whole-prompt encoding where it fails.
"""

from __future__ import annotations

import re
import threading

from tokenizer_svc.cache import LRUCache
from tokenizer_svc.loader import ModelTokenizer

# Probe conversations: boundaries next to whitespace, digits, non-ASCII, empty contents.
_PROBES = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief. 123"}, {"role": "user", "content": "  leading and trailing  "},
     {"role": "assistant", "content": "\n\nOK 你好 🎉\n"}, {"role": "user", "content": ""}],
    [{"role": "system", "content": " x\t"}, {"role": "user", "content": "2+2=4\r\n"}],
]


def _split_pattern(model: ModelTokenizer) -> re.Pattern[str] | None:
    """A regex that captures the special tokens with clean boundaries (no lstrip/rstrip), longest first."""
    tokens = [t.content for t in model.tokenizer.get_added_tokens_decoder().values()
              if t.special and not t.lstrip and not t.rstrip and t.content]
    if not tokens:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


class SegmentEncoder:
    """Encodes rendered chat prompts through a per-process cache of segment encodings."""

    def __init__(self, model: ModelTokenizer, max_bytes: int) -> None:
        self.model = model
        self.pattern = _split_pattern(model)
        self.token_ids = {t.content: i for i, t in model.tokenizer.get_added_tokens_decoder().items()}
        self.cache: LRUCache[list[int]] = LRUCache(max_bytes)
        self.lock = threading.Lock()  # both lanes of a pool process share the cache
        self.enabled = max_bytes > 0 and self._exact()

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a rendered prompt, identical to model.encode(prompt)."""
        if not self.enabled or self.pattern is None:
            return self.model.encode(prompt)
        return self._encode_segments(prompt, self.pattern)

    def _encode_segments(self, prompt: str, pattern: re.Pattern[str]) -> list[int]:
        ids: list[int] = []
        pieces = pattern.split(prompt)  # text, special, text, special, ..., text
        for index, piece in enumerate(pieces):
            if index % 2:
                ids.append(self.token_ids[piece])
            elif piece:
                ids += self._segment(piece)
        return ids

    def _segment(self, text: str) -> list[int]:
        with self.lock:
            cached = self.cache.get(text)
        if cached is None:
            cached = self.model.encode(text)
            with self.lock:
                self.cache.put(text, cached, len(text) + 4 * len(cached))
        return cached

    def _exact(self) -> bool:
        if self.pattern is None:
            return False
        for messages in _PROBES:
            try:
                prompt = self.model.render_chat(messages, add_generation_prompt=True)
            except ValueError:
                return False
            if self._encode_segments(prompt, self.pattern) != self.model.encode(prompt):
                return False
        self.cache.clear()
        self.cache.hits = self.cache.misses = 0
        return True
