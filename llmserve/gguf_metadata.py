"""The GGUF metadata the tokenizer service and the worker both need, read one way with one set of
defaults, so the gateway (which learns them from the tokenizer service) and the worker agree.

    meta = read_metadata(fields.get)     # any key -> value lookup (None when the key is absent)
    meta.context_length, meta.eos_token_ids, meta.bos_token_id, meta.architecture
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_ARCHITECTURE = "llama"
DEFAULT_CONTEXT_LENGTH = 4096
# llama.cpp ends generation on each of these that the file names
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclass(frozen=True)
class GGUFMetadata:
    architecture: str
    context_length: int
    eos_token_ids: tuple[int, ...]    # EOS first, then end-of-turn / end-of-message, no repeats
    bos_token_id: int | None


def read_metadata(get: Callable[[str], Any]) -> GGUFMetadata:
    """GGUF metadata from a key lookup (`get(key)` is None for an absent key)."""
    arch = get("general.architecture") or DEFAULT_ARCHITECTURE
    eos = [int(v) for key in EOS_KEYS if (v := get(key)) is not None]
    bos = get("tokenizer.ggml.bos_token_id")
    context = get(f"{arch}.context_length")
    return GGUFMetadata(
        architecture=arch,
        context_length=int(context) if context is not None else DEFAULT_CONTEXT_LENGTH,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=int(bos) if bos is not None else None,
    )
