"""GGUF file -> ModelConfig + Hugging Face-named weights, via a safetensors cache.

Dequantizing a GGUF (F32/F16/Q8_0/Q4_0/Q4_1, with `gguf.quants.dequantize`) takes
seconds, so the first load converts the file once into
`<cache_dir>/converted/<stem>-<key>.safetensors` (key: path, size, mtime, layout),
and later loads read that file directly.

RoPE layout: llama.cpp stores llama Q/K weights permuted for interleaved-pair
RoPE. By default we undo that permutation so every model runs the HF
rotate_half layout (rope_interleaved=False); `unpermute=False` keeps the GGUF
layout and sets rope_interleaved=True instead (same logits; tested).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file

from gpu_worker.model import architectures
from gpu_worker.model.architectures import Architecture
from gpu_worker.model.config import ModelConfig, RopeScaling
from gpu_worker.ops.weights import gguf_blocks, gguf_weight
from gpu_worker.ops.weights.gguf_weight import FileTensor
from llmserve.catalog import gguf_file, model_store
from llmserve.catalog.gguf_metadata import read_metadata

logger = structlog.get_logger(__name__)

CACHE_FORMAT = "2"  # 2: ModelConfig has the architectures' fields and llama.cpp's end-of-generation EOS set
# architectures whose GGUF Q/K weights llama.cpp permuted for interleaved RoPE
PERMUTED_ARCHS = {a.name for a in architectures.ARCHITECTURES.values() if a.gguf_qk_permuted}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """GGUF tensor name -> HF name of architecture `arch` (ModelConfig.architecture; None for tensors that
    are not model weights, e.g. rope_freqs). Gemma's `ffn_norm` is its pre_feedforward_layernorm, Phi-3's
    `ffn_up` its fused gate_up_proj: the layer names depend on the architecture, so it has no default."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = _BLK.match(gguf_name)
    names = _LAYER_NAMES | architectures.get(arch).gguf_layer_names
    if not match or match.group(2) not in names:
        return None
    return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: interleaved-pair rows per head -> HF rotate_half rows.

    w: [num_heads * D, ...] (weight [rows, H] or bias [rows]) -> same shape.
    llama.cpp: w.reshape(n, 2, D/2, ...).swapaxes(1, 2); the inverse swaps back from (n, D/2, 2, ...).
    """
    rest = w.shape[1:]
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# ---- metadata -> ModelConfig ----------------------------------------------------------------------


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _rope_scaling(reader: GGUFReader, arch: str, source: object) -> RopeScaling | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise architectures.refusal(source, f"GGUF rope scaling {kind!r}")
    return RopeScaling(rope_type="linear", factor=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)))


def _rope_freq_factors(reader: GGUFReader) -> tuple[float, ...] | None:
    """Llama 3.1+ GGUFs carry their RoPE scaling as per-frequency divisors in tensor `rope_freqs`."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return tuple(float(x) for x in dequantize(t.data, t.tensor_type).reshape(-1))
    return None


def _tensor(reader: GGUFReader, name: str):
    return next((t for t in reader.tensors if t.name == name), None)


def _refuse_unsupported(reader: GGUFReader, arch: str, head_dim: int, source: object) -> None:
    """Mixture-of-experts, Phi-3's LongRoPE factors and partial RoPE are refused, in any architecture."""
    experts = _field(reader, f"{arch}.expert_count")
    if experts:
        raise architectures.refusal(source, f"mixture-of-experts ({experts} experts, architecture {arch!r})")
    if _tensor(reader, "rope_factors_long.weight") is not None:
        raise architectures.refusal(source, "LongRoPE (rope_factors_long)")
    rotary = _field(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise architectures.refusal(source, f"partial rotary embeddings ({rotary} of {head_dim} dims)")


def _sliding_layers(reader: GGUFReader, arch: Architecture, num_layers: int) -> tuple[bool, ...]:
    """Which layers are windowed: `{arch}.attention.sliding_window_pattern` where the file has it
    (a period, or one flag per layer), else the architecture's fixed pattern, as llama.cpp does."""
    pattern = _field(reader, f"{arch.gguf_name}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return tuple(bool(p) for p in pattern)
    if pattern:
        arch = dataclasses.replace(arch, sliding_window_pattern=int(pattern))
    return architectures.sliding_layers(arch, num_layers)


def _gemma_fields(reader: GGUFReader, arch: Architecture, hidden: int, heads: int, head_dim: int,
                  layers: int) -> dict:
    """Gemma's extras. Its GGUF has no query_pre_attn_scalar: llama.cpp takes head_dim, except for
    the 27B models (hidden / heads), which it knows by their layer count; likewise Gemma 3's local
    RoPE base is 10000 unless the file says otherwise."""
    if not arch.scale_embeddings:
        return {}
    big = (arch.name, layers) in (("gemma2", 46), ("gemma3", 62))
    local = _field(reader, f"{arch.gguf_name}.rope.freq_base_swa", 10000.0)
    return dict(
        embedding_scale=hidden**0.5, query_pre_attn_scalar=float(hidden // heads if big else head_dim),
        attn_logit_softcap=_field(reader, f"{arch.gguf_name}.attn_logit_softcapping"),
        final_logit_softcap=_field(reader, f"{arch.gguf_name}.final_logit_softcapping"),
        rope_local_theta=float(local) if arch.name == "gemma3" else None,
    )


def read_config(reader: GGUFReader, unpermute: bool = True) -> ModelConfig:
    """GGUF metadata -> ModelConfig; UnsupportedModel (naming the file) for what the worker cannot run."""
    source = getattr(reader.data, "filename", "GGUF file")
    meta = read_metadata(lambda key: _field(reader, key))
    arch_spec = architectures.for_gguf(meta.architecture, source)
    arch = meta.architecture
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    layers = int(_field(reader, f"{arch}.block_count"))
    _refuse_unsupported(reader, arch, head_dim, source)
    window = _field(reader, f"{arch}.attention.sliding_window")
    embed = _tensor(reader, "token_embd.weight")
    return ModelConfig(
        vocab_size=int(embed.shape[-1]),  # ggml shapes are innermost-first: [H, V]
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, source),
        rope_freq_factors=_rope_freq_factors(reader),
        context_length=meta.context_length,
        tie_word_embeddings=_tensor(reader, "output.weight") is None,
        attention_bias=_tensor(reader, "blk.0.attn_q.bias") is not None,
        bos_token_id=meta.bos_token_id,
        eos_token_ids=meta.eos_token_ids,
        rope_interleaved=arch in PERMUTED_ARCHS and not unpermute,
        architecture=arch,
        qk_norm=arch_spec.qk_norm,
        sandwich_norms=arch_spec.sandwich_norms,
        hidden_act=arch_spec.hidden_act,
        sliding_window=int(window) if window else None,
        sliding_layers=_sliding_layers(reader, arch_spec, layers) if window else (),
        **_gemma_fields(reader, arch_spec, hidden, heads, head_dim, layers),
    )


# ---- tensors ----------------------------------------------------------------------------------------


def check_types(path: Path, reader: GGUFReader) -> None:
    """Raise, in one line naming the file, the tensor and its type, where a tensor's type is not supported."""
    for t in reader.tensors:
        if t.tensor_type not in gguf_weight.SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which is not supported "
                             f"(supported: {gguf_weight.supported_names()})")


def _hf_rows(t, w: np.ndarray, config: ModelConfig, unpermute: bool) -> np.ndarray:
    """A tensor's rows (outermost axis) in HF order: llama.cpp's Q/K permutation undone where asked."""
    if unpermute and config.architecture in PERMUTED_ARCHS:
        if t.name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_qk(w, config.num_heads)
        if t.name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_qk(w, config.num_kv_heads)
    return w


def _float32(t, config: ModelConfig, unpermute: bool) -> torch.Tensor:
    """One GGUF tensor -> fp32 torch tensor in HF layout [out, in], gguf's own values."""
    w = dequantize(t.data, t.tensor_type)  # float32, rows outermost
    w = _hf_rows(t, w.reshape(tuple(int(d) for d in reversed(t.shape))), config, unpermute)
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # copy: reader memory is read-only


def _dequantized(t, config: ModelConfig, unpermute: bool) -> torch.Tensor:
    """One GGUF tensor -> torch tensor in HF layout [out, in]; F32 stays fp32, the rest is stored fp16."""
    dtype = torch.float32 if t.tensor_type == GGMLQuantizationType.F32 else torch.float16
    return _float32(t, config, unpermute).to(dtype)


def convert(path: Path, unpermute: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read and dequantize a whole GGUF (slow: seconds). Returns config and HF-named tensors."""
    start = time.monotonic()
    reader = gguf_file.open_reader(path)
    check_types(path, reader)
    config = read_config(reader, unpermute)
    named = [(n, t) for t in reader.tensors if (n := hf_name(t.name, config.architecture)) is not None]
    weights: dict[str, torch.Tensor] = {}
    step = max(1, len(named) // 10)
    for i, (name, t) in enumerate(named, 1):
        weights[name] = _dequantized(t, config, unpermute)
        if i % step == 0 or i == len(named):
            logger.info("dequantizing gguf", done=i, total=len(named), elapsed_s=round(time.monotonic() - start, 1))
    return config, weights


def cache_path(path: Path, unpermute: bool = True) -> Path:
    """Where the converted copy of `path` lives: keyed by absolute path, size, mtime and layout."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{int(unpermute)}|v{CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return model_store.cache_dir() / "converted" / f"{path.stem}-{digest}.safetensors"


def _write_cache(target: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    save_file(weights, str(tmp), metadata={"config": config.to_json(), "format": CACHE_FORMAT})
    tmp.replace(target)  # atomic: a concurrent loader sees the whole file or none


def _iter_cached(target: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(target), framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def load(path: Path, unpermute: bool = True) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Config and (HF name, tensor) pairs of a GGUF, converting into the cache on first use."""
    target = cache_path(path, unpermute)
    if not target.exists():
        logger.info("converting gguf (first load)", path=str(path), cache=str(target))
        config, weights = convert(path, unpermute)
        try:
            _write_cache(target, config, weights)
        except OSError as exc:  # a read-only cache must not stop the worker
            logger.warning("could not write converted cache", error=str(exc))
            return config, iter(weights.items())
        del weights
    with safe_open(str(target), framework="pt") as f:
        config = ModelConfig.from_json(f.metadata()["config"])
    logger.info("loading converted gguf", cache=str(target))
    return config, _iter_cached(target)


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


# ---- tensors in the file's formats (the CPU's --quantization auto) ------------------------------------


def _file_tensor(t, config: ModelConfig, unpermute: bool) -> FileTensor:
    """A 2-D GGUF tensor -> FileTensor [N rows of its bytes] in HF row order (no dequantization)."""
    return FileTensor(t.tensor_type, _hf_rows(t, t.data, config, unpermute), int(t.shape[0]))


def _file_formats(reader: GGUFReader, config: ModelConfig, unpermute: bool
                  ) -> Iterator[tuple[str, torch.Tensor | FileTensor]]:
    for t in reader.tensors:
        name = hf_name(t.name, config.architecture)
        if name is None:
            continue
        if len(t.shape) == 2 and name != "model.embed_tokens.weight":
            yield name, _file_tensor(t, config, unpermute)
            continue
        yield name, _float32(t, config, unpermute)
        if name == "model.embed_tokens.weight" and config.tie_word_embeddings:
            yield "lm_head.weight", _file_tensor(t, config, unpermute)  # the tied head in the file's format


def load_file_formats(path: Path, unpermute: bool = True
                      ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | FileTensor]]] | None:
    """Config and (HF name, weight) pairs of a GGUF whose GEMM weights (and vocab head) stay in the file's
    formats, as FileTensors: no dequantized copy, no cache. Norms, biases and the embedding table (for
    the lookup) come as fp32 tensors. None where no GEMM weight of the file is quantized."""
    reader = gguf_file.open_reader(path)
    config = read_config(reader, unpermute)
    if not any(t.tensor_type in gguf_blocks.QUANTIZED_TYPES and len(t.shape) == 2
               and hf_name(t.name, config.architecture) is not None for t in reader.tensors):
        return None
    check_types(path, reader)
    logger.info("loading gguf in its own weight formats", path=str(path))
    return config, _file_formats(reader, config, unpermute)
