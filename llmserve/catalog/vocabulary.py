"""A model's vocabulary, loaded one way for every service that needs one: the tokenizer service
(encode, decode, chat templates) and the worker (the token table of its grammar store).

    vocab = load_vocabulary(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))   # tokenizer.ggml.* (llmserve/catalog/gguf_vocab.py)
    vocab = load_vocabulary(Path("some-hf-model/"))                    # tokenizer.json + its config files
    vocab.tokenizer, vocab.eos_token_ids, vocab.bos_token, vocab.eos_token, vocab.named_tokens

Token ids are exact: the same as the model's own tokenizer.json under `tokenizers`/`transformers`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from llmserve.catalog import gguf_file
from llmserve.catalog.gguf_metadata import read_metadata
from llmserve.catalog.gguf_vocab import build_tokenizer, read_vocab

NAMED_TOKENS = ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_GGUF_NAMED_TOKENS = {
    "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id",
    "sep_token": "tokenizer.ggml.seperator_token_id", "cls_token": "tokenizer.ggml.cls_token_id",
    "mask_token": "tokenizer.ggml.mask_token_id",
}


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer and the special tokens a model names."""

    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]    # every token that ends generation, the EOS first
    bos_token: str | None
    eos_token: str | None
    named_tokens: dict[str, str]      # of NAMED_TOKENS, those the model names (chat template variables)


def load_vocabulary(path: Path) -> Vocabulary:
    """The vocabulary of a GGUF file or of a Hugging Face model directory.

    Raises:
        FileNotFoundError: no such file, or a directory without tokenizer.json.
        gguf_vocab.UnsupportedTokenizer: a GGUF vocabulary that cannot be reproduced exactly.
    """
    path = Path(path)
    if path.is_dir():
        return hf_vocabulary(path)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    return gguf_vocabulary(gguf_file.metadata(path))


# ---------------------------------------------------------------------------------------------- GGUF

def gguf_vocabulary(fields: Mapping[str, Any]) -> Vocabulary:
    """The vocabulary of a GGUF file's metadata (`gguf_file.metadata`)."""
    vocab = read_vocab(fields)
    tokens = vocab.tokens
    eos_ids = read_metadata(fields.get).eos_token_ids
    return Vocabulary(
        tokenizer=build_tokenizer(vocab),
        eos_token_ids=eos_ids,
        bos_token=tokens[vocab.bos_id] if vocab.bos_id is not None else None,
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        named_tokens=_gguf_named_tokens(fields, tokens),
    )


def _gguf_named_tokens(fields: Mapping[str, Any], tokens: Sequence[str]) -> dict[str, str]:
    named = {}
    for name, key in _GGUF_NAMED_TOKENS.items():
        value = fields.get(key)
        if value is not None and 0 <= int(value) < len(tokens):
            named[name] = tokens[int(value)]
    return named


# ------------------------------------------------------------------------------------ HF directory

def read_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON config file; {} when the directory has none."""
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a token as "text" or {"content": "text", ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def hf_vocabulary(directory: Path) -> Vocabulary:
    """The vocabulary of a Hugging Face model directory (tokenizer.json and its config files)."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.exists():
        raise FileNotFoundError(f"{directory} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tok_config = read_json(directory / "tokenizer_config.json")
    eos_token = token_content(tok_config.get("eos_token"))
    configs = (read_json(directory / "generation_config.json"), read_json(directory / "config.json"))
    named = {name: token_content(tok_config.get(name)) for name in NAMED_TOKENS}
    return Vocabulary(
        tokenizer=tokenizer,
        eos_token_ids=tuple(_hf_eos_ids(tokenizer, eos_token, *configs)),
        bos_token=token_content(tok_config.get("bos_token")),
        eos_token=eos_token,
        named_tokens={name: content for name, content in named.items() if content},
    )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _hf_eos_ids(tokenizer: Tokenizer, eos_token: str | None, *configs: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    eos_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
    if eos_id is not None:
        ids.append(eos_id)
    for config in configs:
        ids += [i for i in _as_id_list(config.get("eos_token_id")) if i not in ids]
    return ids
