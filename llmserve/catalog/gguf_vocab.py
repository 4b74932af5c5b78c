"""Build a Hugging Face `tokenizers.Tokenizer` from the tokenizer metadata of a GGUF file.

Two vocabulary families, chosen by `tokenizer.ggml.model`:

    "gpt2"  byte-level BPE: tokens (already in GPT-2 byte-to-unicode form) + merges,
            pre-tokenizer chosen by `tokenizer.ggml.pre` (same regexes as llama.cpp
            and as the model's own tokenizer.json)
    "llama" SentencePiece-style BPE: tokens + scores, merges derived from the scores,
            byte fallback (<0xNN> tokens), spaces as "▁" (optionally one prepended to
            each text fragment, as llama.cpp does): Llama 2, Mistral, Phi-3, Gemma.
            Gemma files differ twice: tokens of several spaces are stored as spaces,
            and their merge order is the token order, not the scores'.

Token types (llama.cpp `llama_token_type`) decide what becomes an added token:
CONTROL / UNKNOWN → special added token; USER_DEFINED → non-special added token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's LLAMA3 and QWEN2 pre-tokenizer regexes (identical to the Split patterns of their tokenizer.json).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class UnsupportedTokenizer(ValueError):
    """The GGUF describes a tokenizer this loader cannot reproduce exactly."""


# general.architecture values whose "llama" vocabulary is Gemma's
GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata of one GGUF file."""

    model: str                      # "gpt2" | "llama"
    pre: str                        # pre-tokenizer name ("smollm", "llama-bpe", "qwen2", "default", ...)
    tokens: Sequence[str]
    token_types: Sequence[int]
    scores: Sequence[float] | None
    merges: Sequence[str] | None
    bos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_space_prefix: bool
    architecture: str = "llama"     # general.architecture


def _split_then_bytelevel(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])


def _digits_then_bytelevel() -> pre_tokenizers.PreTokenizer:
    # SmolLM2 / StarCoder: every digit its own pre-token, then the GPT-2 regex.
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def _gpt2_bytelevel() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_bytelevel,
    "gpt-2": _gpt2_bytelevel,
    "gpt2": _gpt2_bytelevel,
    "smollm": _digits_then_bytelevel,
    "starcoder": _digits_then_bytelevel,
    "refact": _digits_then_bytelevel,
    "codeshell": _digits_then_bytelevel,
    "llama-bpe": lambda: _split_then_bytelevel(LLAMA3_PATTERN),
    "llama3": lambda: _split_then_bytelevel(LLAMA3_PATTERN),
    "dbrx": lambda: _split_then_bytelevel(LLAMA3_PATTERN),
    "smaug-bpe": lambda: _split_then_bytelevel(LLAMA3_PATTERN),
    "qwen2": lambda: _split_then_bytelevel(QWEN2_PATTERN),
    "deepseek-r1-qwen": lambda: _split_then_bytelevel(QWEN2_PATTERN),
    "stablelm2": lambda: _split_then_bytelevel(QWEN2_PATTERN),
}
# Pre-tokenizers whose tokenizer.json also normalizes to NFC first.
NFC_PRES = frozenset({"qwen2", "deepseek-r1-qwen"})


def read_vocab(fields: Mapping[str, Any]) -> GGUFVocab:
    """The tokenizer part of GGUF metadata (`fields`: key → python value)."""
    model = fields.get("tokenizer.ggml.model")
    if model is None:
        raise UnsupportedTokenizer("GGUF has no tokenizer.ggml.model")
    tokens = fields["tokenizer.ggml.tokens"]
    return GGUFVocab(
        model=model,
        pre=fields.get("tokenizer.ggml.pre", "default"),
        tokens=tokens,
        token_types=fields.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens),
        scores=fields.get("tokenizer.ggml.scores"),
        merges=fields.get("tokenizer.ggml.merges"),
        bos_id=fields.get("tokenizer.ggml.bos_token_id"),
        unk_id=fields.get("tokenizer.ggml.unknown_token_id"),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", model == "llama")),
        architecture=fields.get("general.architecture") or "llama",
    )


def _added_tokens(vocab: GGUFVocab) -> list[AddedToken]:
    """CONTROL/UNKNOWN tokens as special added tokens, USER_DEFINED as plain added tokens, in id order."""
    added = []
    for token, kind in zip(vocab.tokens, vocab.token_types):
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _bos_processor(vocab: GGUFVocab) -> processors.PostProcessor | None:
    if not vocab.add_bos or vocab.bos_id is None:
        return None
    bos = vocab.tokens[vocab.bos_id]
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                         special_tokens=[(bos, vocab.bos_id)])


def _register_added(tokenizer: Tokenizer, added: list[AddedToken]) -> None:
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])


def build_gpt2(vocab: GGUFVocab) -> Tokenizer:
    """Byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2 ...)."""
    if vocab.pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizer(f"unknown tokenizer.ggml.pre {vocab.pre!r}; known: {', '.join(PRE_TOKENIZERS)}")
    if not vocab.merges:
        raise UnsupportedTokenizer("gpt2 tokenizer without tokenizer.ggml.merges")
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    merges = [_merge_pair(m) for m in vocab.merges]
    tokenizer = Tokenizer(models.BPE(ids, merges, fuse_unk=False, byte_fallback=False, ignore_merges=False))
    if vocab.pre in NFC_PRES:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[vocab.pre]()
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos = _bos_processor(vocab)
    tokenizer.post_processor = processors.Sequence([byte_level, bos]) if bos else byte_level
    _register_added(tokenizer, _added_tokens(vocab))
    return tokenizer


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score order: a pair (l, r) ranks by the score
    of the piece l+r (higher first), as transformers' SentencePieceExtractor derives them."""
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == TOKEN_NORMAL}
    ranked = []
    for piece, piece_id in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[piece_id], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _merge_pair(merge: str) -> tuple[str, str]:
    """One `tokenizer.ggml.merges` entry ("left right") as the pair BPE merges."""
    left, space, right = merge.partition(" ")
    if not space:
        raise UnsupportedTokenizer(f"merge {merge!r} is not two tokens")
    return left, right


def _gemma_respelled(vocab: GGUFVocab) -> GGUFVocab:
    """Gemma: its runs-of-spaces tokens as the "▁" runs the normalizer makes of the text, and merges
    ranked by token order (transformers' GGUF Gemma converter does the same)."""
    tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in vocab.tokens]
    return dataclasses.replace(vocab, tokens=tokens, scores=[-float(i) for i in range(len(tokens))])


def build_llama(vocab: GGUFVocab) -> Tokenizer:
    """SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Phi-3, Gemma, TinyLlama ...)."""
    if vocab.architecture in GEMMA_ARCHS:
        vocab = _gemma_respelled(vocab)
    if vocab.scores is None:
        raise UnsupportedTokenizer("llama tokenizer without tokenizer.ggml.scores")
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    merges = spm_merges(vocab.tokens, vocab.scores, vocab.token_types)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tokenizer = Tokenizer(models.BPE(ids, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # Spaces become "▁"; with add_space_prefix every text fragment gets one "▁" in front, also after a
    # special token, as llama.cpp does (and transformers' GGUF/legacy Llama conversion).
    prefix = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []),
    ])
    bos = _bos_processor(vocab)
    if bos:
        tokenizer.post_processor = bos
    _register_added(tokenizer, _added_tokens(vocab))
    return tokenizer


BUILDERS: dict[str, Callable[[GGUFVocab], Tokenizer]] = {"gpt2": build_gpt2, "llama": build_llama}


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """The tokenizers.Tokenizer of a GGUF vocabulary; UnsupportedTokenizer when it cannot be exact."""
    builder = BUILDERS.get(vocab.model)
    if builder is None:
        raise UnsupportedTokenizer(f"unsupported tokenizer.ggml.model {vocab.model!r}; known: {', '.join(BUILDERS)}")
    return builder(vocab)
