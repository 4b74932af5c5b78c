"""Paged KV cache storage: per layer one K and one V tensor of fixed-size blocks.

Which block belongs to which sequence is the engine's business (block manager);
this module only owns the memory and its sizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in `budget_bytes` (0 if not even one)."""
    return max(0, int(budget_bytes) // bytes_per_block(config, block_size, dtype))


@dataclass
class KVCache:
    # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
    ) -> KVCache:
        """Zero-filled, so padded (masked) slots never hold NaN/Inf that 0 * x would spread."""
        assert num_blocks > 0 and block_size > 0
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        return cls(k, v)

    bytes_per_block = staticmethod(bytes_per_block)
    num_blocks_for_budget = staticmethod(num_blocks_for_budget)

    @property
    def num_blocks(self) -> int:
        return int(self.k_caches[0].shape[0])

    @property
    def block_size(self) -> int:
        return int(self.k_caches[0].shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.k_caches[0].dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_caches, *self.v_caches))
