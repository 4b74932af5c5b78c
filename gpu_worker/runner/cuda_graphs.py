"""CUDA-graph capture of pure-decode steps, one graph per batch size, replayed with static buffers.

A decode step launches hundreds of small kernels; replaying a captured graph removes their Python
and launch overhead. Shapes in a graph are frozen, so each captured batch size B owns static input
buffers; a step of n <= B sequences is padded up to the smallest captured B >= n:

    rows  0 .. n-1 : the real sequences
    rows  n .. B-1 : padding: slot -1 (no KV write), context length 0 (attention reads nothing)

Steps with prefills, or more sequences than the largest captured size, run eagerly.
The model must not sync with the host on the decode path. The CUDA ops backend does not, except
where it falls back to the torch reference (a KV cache the decode kernel does not cover): such a
model is never captured, every step runs eagerly (`eager_only_reason`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.ops.cuda import kernels


def eager_only_reason(kv_cache) -> str | None:
    """Why decode steps over this cache cannot be captured (None when they can): for a head_dim,
    block size or dtype the decode kernel lacks, attention runs the torch reference, which reads
    context lengths on the host, and a host sync inside capture fails; a cache of several KV groups
    needs block tables per group."""
    _, block_size, _, head_dim = kv_cache.k_caches[0].shape
    dtype = kv_cache.k_caches[0].dtype
    if len(kv_cache.layout.windows) > 1:  # the static inputs hold one group's block tables
        return f"{len(kv_cache.layout.windows)} KV groups (sliding-window and full layers)"
    if kernels.decode_kernel_supports(head_dim, block_size, dtype):
        return None
    return f"no decode kernel for head_dim {head_dim}, block_size {block_size}, {dtype}"


class _StaticDecodeInputs:
    """The device buffers one captured graph reads; copied into before every replay."""

    def __init__(self, batch: int, max_blocks: int, device: torch.device) -> None:
        i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(batch, **i64)                    # [B]
        self.positions = torch.zeros(batch, **i64)                    # [B]
        self.slot_mapping = torch.full((batch,), -1, **i64)           # [B]
        self.context_lens = torch.zeros(batch, **i32)                 # [B]
        self.block_tables = torch.zeros(batch, max_blocks, **i32)     # [B, max_blocks]
        self.meta = AttentionMetadata(
            slot_mapping=self.slot_mapping, num_prefills=0, num_prefill_tokens=0,
            prefill_query_start_loc=torch.zeros(1, **i32), prefill_context_lens=torch.zeros(0, **i32),
            prefill_block_tables=torch.zeros(0, max_blocks, **i32), decode_context_lens=self.context_lens,
            decode_block_tables=self.block_tables, logits_indices=torch.arange(batch, **i64),
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a step of n sequences into rows 0..n-1 and reset the padding rows."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:].fill_(-1)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.context_lens[n:].fill_(0)
        width = meta.decode_block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.block_tables[:n, width:].fill_(0)


class DecodeGraphRunner:
    """Captures `model(input_ids, positions, meta, kv_cache)` for pure-decode batches.

    Args:
        model: forward(input_ids [T], positions [T], meta, kv_cache) -> logits [num_seqs, vocab].
        kv_cache: the paged cache the model reads and writes (its tensors are baked into the graphs).
        batch_sizes: decode batch sizes to capture, e.g. (1, 2, 4, 8, 16, 32, 64).
        max_blocks: block-table width of the graphs (max context / block_size); wider tables run eagerly.
        forward: optional override of how the model is called (same arguments as above).
    """

    def __init__(self, model, kv_cache, batch_sizes: Iterable[int], max_blocks: int,
                 forward: Callable | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.max_blocks = max_blocks
        self.batch_sizes = sorted(set(batch_sizes))
        self._forward = forward or (lambda ids, pos, meta: model(ids, pos, meta, kv_cache))
        self._inputs: dict[int, _StaticDecodeInputs] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the graphs' shared memory pool (torch's opaque handle) once one is captured
        self.disabled_reason = eager_only_reason(kv_cache)

    def capture(self) -> None:
        """Capture every batch size, largest first, sharing one memory pool (none when disabled_reason)."""
        if self.disabled_reason is not None:
            return
        device = self.kv_cache.k_caches[0].device
        for batch in reversed(self.batch_sizes):
            inputs = _StaticDecodeInputs(batch, self.max_blocks, device)
            self._warm_up(inputs)
            graph = torch.cuda.CUDAGraph()
            # relaxed: CuPy's DLPack import may query pointer attributes, harmless but not a stream op
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="relaxed"):
                self._outputs[batch] = self._forward(inputs.input_ids, inputs.positions, inputs.meta)
            self._pool = graph.pool()
            self._inputs[batch], self._graphs[batch] = inputs, graph
        torch.cuda.synchronize(device)

    def _warm_up(self, inputs: _StaticDecodeInputs) -> None:
        """Run once eagerly on a side stream: compiles kernels and settles allocator state."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            self._forward(inputs.input_ids, inputs.positions, inputs.meta)
        torch.cuda.current_stream().wait_stream(stream)

    def graph_batch(self, num_seqs: int, meta: AttentionMetadata) -> int | None:
        """The captured size that serves this step, or None (eager)."""
        if meta.num_prefills or meta.decode_block_tables.shape[1] > self.max_blocks:
            return None
        return next((b for b in self.batch_sizes if b >= num_seqs and b in self._graphs), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [num_seqs, vocab]; from a graph replay when the step fits one, else eager.

        A replayed result is a view of the graph's output buffer: valid until the next replay.
        """
        num_seqs = input_ids.shape[0]
        batch = self.graph_batch(num_seqs, meta)
        if batch is None:
            return self._forward(input_ids, positions, meta)
        self._inputs[batch].load(input_ids, positions, meta)
        self._graphs[batch].replay()
        return self._outputs[batch][:num_seqs]
