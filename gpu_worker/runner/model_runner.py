"""The model runner: between the engine and the model, one scheduled batch -> one forward on the device.

    engine ──(scheduled batch, block tables)──▶ ModelRunner.execute
        copy-on-write KV blocks, then model_input.build_model_input: ids, positions, AttentionMetadata
        forward, the first that takes the step:
            a captured CUDA graph        pure decodes of a captured batch size (cuda_graphs.py)
            every layer in one C call    CPU, int4 weights (cpu_step_layers.py)
            model(...)                   the model's layers over its backend's ops
    ◀── logits [num_rows, vocab] float32, rows in batch order: a sequence's last token, or every
        position of a drafted one (ScheduledSeq.num_logits)

Each path gives a sequence the same bits (tests/unit/test_cpu_step_layers.py, tests/gpu), so which
one ran never shows in the output.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.scheduler import ScheduledSeq
from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.ops import get_backend
from gpu_worker.runner.cpu_step_layers import StepLayers
from gpu_worker.runner.cuda_graphs import DecodeGraphRunner
from gpu_worker.runner.model_input import build_model_input


class ModelRunner:
    """Runs `model` over `kv_cache` on the cache's device.

    Args:
        model: a loaded model (weights already in its backend's form, Backend.prepare_weights).
        kv_cache: the paged cache the model reads and writes.
    """

    def __init__(self, model: LlamaModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.k_caches[0].device
        self.backend = get_backend(self.device)
        self.step_layers = StepLayers.build(model)  # None unless the weights are the C step's
        self.decode_graphs: DecodeGraphRunner | None = None  # set by capture_decode_graphs (CUDA)

    def capture_decode_graphs(self, batch_sizes: Iterable[int], max_blocks: int) -> None:
        """Capture pure-decode steps of these batch sizes with block tables up to max_blocks wide."""
        graphs = DecodeGraphRunner(self.model, self.kv_cache, batch_sizes, max_blocks)
        graphs.capture()
        self.decode_graphs = graphs

    def execute(self, scheduled: list[ScheduledSeq], blocks: BlockManager,
                copy_on_write: list[tuple[int, int]]) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """(the batch in logits-row order, logits [num_rows, vocab]) of one step."""
        self._copy_blocks(copy_on_write)
        inp = build_model_input(scheduled, blocks, self.device)
        return inp.batch, self.forward(inp.input_ids, inp.positions, inp.meta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> logits [num_rows, vocab] float32 (a graph replay's is a view
        of the graph's output, valid until the next step)."""
        if self.decode_graphs is not None:
            return self.decode_graphs.run(input_ids, positions, meta)
        if self.step_layers is not None and self.step_layers.takes(positions, meta, self.kv_cache):
            return self._forward_in_c(input_ids, positions, meta)
        return self.model(input_ids, positions, meta, self.kv_cache)

    @torch.inference_mode()
    def _forward_in_c(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward with its layers replaced by one C call: the same bits."""
        assert self.step_layers is not None
        h = self.model.embed_tokens(input_ids)  # [T, H]
        h, residual = self.step_layers(h, positions, meta, self.kv_cache)
        return self.model.compute_logits(self.backend, h, residual, meta)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (src, dst) block in every layer's K and V cache (copy-on-write of a shared block)."""
        for src, dst in pairs:
            for cache in self.kv_cache.tensors():
                cache[dst].copy_(cache[src])
