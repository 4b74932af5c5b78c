"""Paged KV cache storage: pages of fixed-size blocks, and which layer keeps its KV where.

Which block belongs to which sequence is the engine's business (block manager); this module
owns the memory, its sizing and the layout of layers over it (KVLayout).

A block is a page holding `block_size` tokens of KV for `page_layers` layers (one K and one V
tensor per slot). Layers that attend the same way form a KV group and share one block table
per sequence. A model whose layers all attend alike is one group, one slot per layer (a block
holds every layer, as in a plain paged cache). A model that interleaves sliding-window layers
with full ones (Gemma 2/3) gets groups of `page_layers` layers each, so a windowed group's
table can give back the blocks that fell out of its window while the full groups keep theirs
(vLLM's hybrid KV cache manager does the same):

    gemma3, 6 layers, layer 5 full, 0-4 windowed  ->  page_layers 1, 6 groups
      group 0  full      layer 5   slot 0   table  b0 b1 b2 b3 b4 b5
      group 1  window 8  layer 0   slot 0   table  --  --  -- b9 b11 b12    (-- given back)
      ...
      group 5  window 8  layer 4   slot 0   table  --  --  -- b21 b22 b23

Every group takes blocks from one pool, so free counts stay one number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    """Which KV group and page slot each layer uses, and each group's window (None: full attention)."""

    windows: tuple[int | None, ...]   # per group
    layer_group: tuple[int, ...]      # per layer
    layer_slot: tuple[int, ...]       # per layer: its K/V tensor in a page, 0 .. page_layers - 1
    page_layers: int

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVLayout:
        """Every layer in one group with its own slot (a block holds all layers)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def kv_layout(config: ModelConfig) -> KVLayout:
    """One group where every layer has the same window (or none); else groups of
    min(#full, #windowed) layers, full groups first, so windowed groups can drop out-of-window blocks."""
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    full = [i for i, w in enumerate(windows) if w is None]
    windowed = [i for i, w in enumerate(windows) if w is not None]
    if not full or not windowed:
        return KVLayout.single(config.num_layers, windows[0])
    page = min(len(full), len(windowed))
    groups = [full[k:k + page] for k in range(0, len(full), page)]
    groups += [windowed[k:k + page] for k in range(0, len(windowed), page)]
    layer_group, layer_slot = [0] * config.num_layers, [0] * config.num_layers
    for g, layers in enumerate(groups):
        for slot, layer in enumerate(layers):
            layer_group[layer], layer_slot[layer] = g, slot
    return KVLayout(tuple(windows[layers[0]] for layers in groups), tuple(layer_group), tuple(layer_slot), page)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block (a page of kv_layout(config)) takes, K and V together."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * kv_layout(config).page_layers * block_size * config.num_kv_heads * config.head_dim * elem


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in `budget_bytes` (0 if not even one)."""
    return max(0, int(budget_bytes) // bytes_per_block(config, block_size, dtype))


@dataclass
class KVCache:
    # per layer: [num_blocks, block_size, num_kv_heads, head_dim], its slot's tensor (layers of
    # different groups in the same slot share it, each through its own group's block ids)
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    layout: KVLayout

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device,
        layout: KVLayout | None = None,
    ) -> KVCache:
        """Zero-filled, so padded (masked) slots never hold NaN/Inf that 0 * x would spread.
        layout: default one group (a block holds every layer); the engine passes kv_layout(config)."""
        assert num_blocks > 0 and block_size > 0
        layout = layout or KVLayout.single(config.num_layers)
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.page_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.page_layers)]
        return cls([k[s] for s in layout.layer_slot], [v[s] for s in layout.layer_slot], layout)

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

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct K and V tensor (one per page slot each)."""
        return list({id(t): t for t in (*self.k_caches, *self.v_caches)}.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
