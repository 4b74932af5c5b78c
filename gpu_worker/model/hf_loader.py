"""Hugging Face checkpoint directory: config.json + *.safetensors (single or sharded). No hub access."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from gpu_worker.model import architectures
from gpu_worker.model.architectures import Architecture
from gpu_worker.model.config import ModelConfig, RopeScaling
from llmserve.catalog.gguf_metadata import DEFAULT_CONTEXT_LENGTH

logger = structlog.get_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope_params(cfg: dict, layer_type: str = "full_attention") -> dict:
    """The RoPE parameters of one layer type: `rope_parameters` (transformers 5.x, keyed by layer type
    where those differ, as Gemma 3's) or `rope_scaling` + `rope_theta` (4.x)."""
    raw = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if layer_type in raw or "full_attention" in raw:
        raw = raw.get(layer_type) or {}
    return raw


def _rope_scaling(cfg: dict, source: Path) -> RopeScaling | None:
    """The full-attention layers' RoPE scaling, None for plain RoPE."""
    raw = _rope_params(cfg)
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise architectures.refusal(source, f"rope scaling {kind!r}")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return RopeScaling(rope_type=kind, **{k: raw[k] for k in keys if k in raw})


def _rope_theta(cfg: dict, layer_type: str, default: float) -> float:
    return float(_rope_params(cfg, layer_type).get("rope_theta") or cfg.get("rope_theta") or default)


def _local_rope_theta(cfg: dict, arch: Architecture) -> float | None:
    """Gemma 3: the windowed layers' own RoPE base (4.x `rope_local_base_freq`)."""
    if arch.name != "gemma3":
        return None
    return float(cfg.get("rope_local_base_freq") or _rope_theta(cfg, "sliding_attention", 10000.0))


def _sliding(cfg: dict, arch: Architecture, num_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """(sliding_window, which layers use it) from `layer_types` where the config lists them, else from the
    architecture's pattern (or Gemma 3's `sliding_window_pattern`)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if not window:
        return None, ()
    if cfg.get("layer_types"):
        return int(window), tuple(t == "sliding_attention" for t in cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if pattern:
        arch = dataclasses.replace(arch, sliding_window_pattern=int(pattern))
    return int(window), architectures.sliding_layers(arch, num_layers)


def _eos_ids(model_dir: Path, cfg: dict) -> tuple[int, ...]:
    ids = list(_as_ids(cfg.get("eos_token_id")))
    gen = model_dir / "generation_config.json"
    if gen.exists():
        ids += [i for i in _as_ids(json.loads(gen.read_text()).get("eos_token_id")) if i not in ids]
    return tuple(ids)


def _refuse_unsupported(cfg: dict, source: Path) -> None:
    """Mixture-of-experts, vision towers and partial RoPE are refused, whatever the model_type."""
    if cfg.get("vision_config") or cfg.get("text_config"):
        raise architectures.refusal(source, f"a vision tower (model_type {cfg.get('model_type')!r} is multimodal)")
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts:
        raise architectures.refusal(source, f"mixture-of-experts ({experts} experts)")
    if float(_rope_params(cfg).get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise architectures.refusal(source, "partial rotary embeddings (partial_rotary_factor < 1)")


def _activation(cfg: dict, source: Path) -> str:
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if name not in _ACTIVATIONS:
        raise architectures.refusal(source, f"activation {name!r}")
    return _ACTIVATIONS[name]


def architecture(model_dir: Path) -> Architecture:
    """The architecture config.json names (UnsupportedModel for one the worker cannot run)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    _refuse_unsupported(cfg, model_dir)
    return architectures.for_hf(cfg.get("model_type", "llama"), model_dir)


def load_config(model_dir: Path) -> ModelConfig:
    """config.json -> ModelConfig (any architecture of gpu_worker/model/architectures.py)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = architecture(model_dir)
    model_type = cfg.get("model_type", "llama")
    heads, hidden, layers = int(cfg["num_attention_heads"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    window, sliding = _sliding(cfg, arch, layers)
    gemma = arch.scale_embeddings
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, "full_attention", 10000.0),
        rope_scaling=_rope_scaling(cfg, model_dir),
        context_length=int(cfg.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(model_dir, cfg),
        rope_interleaved=False,
        architecture=model_type if arch.name == "llama" else arch.name,
        qk_norm=arch.qk_norm,
        sandwich_norms=arch.sandwich_norms,
        hidden_act=_activation(cfg, model_dir),
        embedding_scale=hidden**0.5 if gemma else None,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 0) or None,
        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=_local_rope_theta(cfg, arch),
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
    """(HF name, tensor) for every tensor of every shard, one tensor in memory at a time; norm weights
    as the multipliers the model applies (Gemma's 1 + w, added in fp32)."""
    offset = architecture(model_dir).hf_norm_offset
    files = weight_files(model_dir)
    for n, path in enumerate(files, 1):
        logger.info("loading safetensors shard", shard=n, shards=len(files), file=path.name)
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor.float() + offset if offset and name.endswith("norm.weight") else tensor


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists()
