"""The GGUF metadata the tokenizer service and the worker both need, read one way with one set of
defaults, so the gateway (which learns them from the tokenizer service) and the worker agree.

    meta = read_metadata(fields.get)     # any key -> value lookup (None when the key is absent)
    meta.context_length, meta.eos_token_ids, meta.bos_token_id, meta.architecture, meta.weight_format
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_ARCHITECTURE = "llama"
DEFAULT_CONTEXT_LENGTH = 4096
# llama.cpp ends generation on each of these that the file names
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# ... and on every token spelled like one of these, whatever the keys say (llama-vocab.cpp's end-of-
# generation set): a Llama 3 Instruct file names <|end_of_text|> as EOS, yet its turns end in
# <|eot_id|>; Gemma's in <end_of_turn>, Phi-3's in <|end|>, ChatML models' in <|im_end|>.
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
    "<｜end▁of▁sentence｜>", "<end_of_utterance>",
})
# general.file_type (llama.cpp's llama_ftype) -> the name llama-quantize gives it
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    21: "Q2_K_S", 32: "BF16",
}


@dataclass(frozen=True)
class GGUFMetadata:
    architecture: str
    context_length: int
    eos_token_ids: tuple[int, ...]    # EOS, end-of-turn / end-of-message, then END_OF_GENERATION_TEXTS; no repeats
    bos_token_id: int | None
    weight_format: str                # "GGUF Q4_K_M" (general.file_type), "GGUF" where the file does not say


def _end_of_generation_ids(tokens: list[str] | None) -> list[int]:
    return [i for i, text in enumerate(tokens or ()) if text in END_OF_GENERATION_TEXTS]


def _weight_format(file_type: Any) -> str:
    if file_type is None:
        return "GGUF"
    return f"GGUF {FILE_TYPES.get(int(file_type), f'file_type {int(file_type)}')}"


def read_metadata(get: Callable[[str], Any]) -> GGUFMetadata:
    """GGUF metadata from a key lookup (`get(key)` is None for an absent key)."""
    arch = get("general.architecture") or DEFAULT_ARCHITECTURE
    eos = [int(v) for key in EOS_KEYS if (v := get(key)) is not None]
    eos += _end_of_generation_ids(get("tokenizer.ggml.tokens"))
    bos = get("tokenizer.ggml.bos_token_id")
    context = get(f"{arch}.context_length")
    return GGUFMetadata(
        architecture=arch,
        context_length=int(context) if context is not None else DEFAULT_CONTEXT_LENGTH,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=int(bos) if bos is not None else None,
        weight_format=_weight_format(get("general.file_type")),
    )
