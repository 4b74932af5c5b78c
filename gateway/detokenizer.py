"""Incremental detokenization: text for each new batch of token ids, never
splitting a multi-byte UTF-8 character.

Byte-level BPE tokens can end in the middle of a character (an emoji is often
2-4 tokens). Decoding a token alone would give U+FFFD, so we decode a short
window and emit only the part that grew and does not end in U+FFFD:

    ids:   ... | prefix_offset ......... read_offset ........ len(ids)
                 └── prefix_text ──────┘
                 └── full_text ──────────────────────────────────┘
    emit full_text[len(prefix_text):] once it is complete, then slide the window.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids as they come; get back the text that is now complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special)

    def feed(self, token_ids: Sequence[int]) -> str:
        """Append tokens; the newly complete text (may be "")."""
        self.ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        if not full_text.startswith(prefix_text):
            # A decoder rewrote earlier text; emit nothing rather than something inconsistent.
            return ""
        new = full_text[len(prefix_text):]
        self._slide()
        return new

    def _slide(self) -> None:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)

    def flush(self) -> str:
        """At the end: whatever is still held back, less a trailing partial character.

        A completion cut by max_new_tokens can stop inside a multi-byte character; those bytes are
        no text, so they are dropped rather than sent as U+FFFD (the token ids still carry them).
        """
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self._slide()
        tail = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        return tail.rstrip(REPLACEMENT)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character a BPE vocabulary writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_decoder()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Each token's own bytes and text (for logprobs): a token alone may be part of a character, so
    its bytes are exact and its text decodes them with U+FFFD for what is incomplete."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        if token_id not in self._cache:
            self._cache[token_id] = self._bytes(token_id)
        return self._cache[token_id]

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if all(c in _BYTE_LEVEL for c in piece):            # byte-level BPE (GPT-2, SmolLM2, Llama 3)
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if match := _BYTE_TOKEN.fullmatch(piece):            # SentencePiece byte fallback
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece word piece
