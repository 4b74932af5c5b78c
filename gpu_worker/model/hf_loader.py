"""Hugging Face checkpoint directory: config.json + *.safetensors (single or sharded). No hub access."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from gpu_worker.model.config import ModelConfig, RopeScaling
from llmserve.gguf_metadata import DEFAULT_CONTEXT_LENGTH

logger = structlog.get_logger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
INDEX_FILE = "model.safetensors.index.json"


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope_scaling(cfg: dict) -> RopeScaling | None:
    """`rope_scaling` (transformers 4.x) or `rope_parameters` (5.x) -> RopeScaling, None for plain RoPE."""
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: llama3, linear)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return RopeScaling(rope_type=kind, **{k: raw[k] for k in keys if k in raw})


def _context_length(cfg: dict) -> int:
    length = int(cfg.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window and int(window) < length:
        # full attention is exact only inside the window; cap instead of silently diverging
        logger.warning("sliding window caps the context", sliding_window=window, max_positions=length)
        length = int(window)
    return length


def _eos_ids(model_dir: Path, cfg: dict) -> tuple[int, ...]:
    ids = list(_as_ids(cfg.get("eos_token_id")))
    gen = model_dir / "generation_config.json"
    if gen.exists():
        ids += [i for i in _as_ids(json.loads(gen.read_text()).get("eos_token_id")) if i not in ids]
    return tuple(ids)


def load_config(model_dir: Path) -> ModelConfig:
    """config.json -> ModelConfig (Llama / Mistral / Qwen2)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    heads = int(cfg["num_attention_heads"])
    rope_params = cfg.get("rope_parameters") or {}
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(cfg),
        context_length=_context_length(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(model_dir, cfg),
        rope_interleaved=False,
        architecture=model_type,
    )


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, else every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every shard, one tensor in memory at a time."""
    files = weight_files(model_dir)
    for n, path in enumerate(files, 1):
        logger.info("loading safetensors shard", shard=n, shards=len(files), file=path.name)
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists()
