"""RoPE tables: inverse frequencies (with Llama 3 / linear scaling) and the cos/sin table the ops read."""

from __future__ import annotations

import math

import torch

from gpu_worker.model.config import ModelConfig, RopeScaling


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, smooth blend in between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


_SCALERS = {
    "llama3": _llama3_scale,
    "linear": lambda inv_freq, s: inv_freq / s.factor,
}


def inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float64 inverse frequencies, scaling included."""
    dim = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if config.rope_scaling is not None:
        if config.rope_scaling.rope_type not in _SCALERS:
            raise ValueError(f"unsupported rope scaling type {config.rope_scaling.rope_type!r}")
        freqs = _SCALERS[config.rope_scaling.rope_type](freqs, config.rope_scaling)
    if config.rope_freq_factors is not None:
        freqs = freqs / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    return freqs


def cos_sin_table(config: ModelConfig, max_positions: int, device: str | torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32: [:, :D/2] = cos(p * inv_freq), [:, D/2:] = sin(p * inv_freq)."""
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq(config))  # [P, D/2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device=device, dtype=torch.float32)
