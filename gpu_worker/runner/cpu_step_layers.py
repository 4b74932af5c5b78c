"""Every decoder layer of a CPU step in one C call (ops/cpu/step_layers.c), in place of the model's layers.

`StepLayers.build(model)` is what the runner keeps where this applies: an fp32 model whose layers'
four GEMM weights are all on the C kernels (int4 on the block kernel, the CPU default, as
CpuBackend.prepare_weights leaves them, or a GGUF file's own blocks in any mix of types, across weights
and within a fused one), without a QKV bias. `takes(...)` says whether a step can
run here (an fp32 KV cache): decodes, prefill chunks and both together. The C file calls the same
kernels the Python path (llama.py over the CPU backend) calls, so both give the same bits for a
token. One call a step saves the Python between ops, most of a short prefill's time
(docs/performance.md, "Figures behind the CPU kernels' settings").
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.llama import GEMMS, LlamaModel
from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.ops.cpu import block_linear, build, paged_attention, step_layers
from gpu_worker.ops.weights.gguf_weight import RowsWeight
from gpu_worker.ops.weights.quantized_linear import BlockWeight, KQuantWeight

NORMS = ("input_norm", "post_norm")


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


class StepLayers:
    """The layers of one prepacked model as the C file takes them: pointers to its weights, which
    stay where they are from now on (a prepacked model is inference-only; `_tensors` keeps them alive)."""

    def __init__(self, model: LlamaModel, weights: list[tuple[step_layers.Weight, list[object]]]) -> None:
        """weights: describe() of every layer's GEMMS, in order."""
        library = step_layers.library()
        assert library is not None, "build() checks that the kernel is built"
        self._run = library.step_layers_f32
        self.config = model.config
        self.num_layers = len(model.layers)
        norms = [getattr(layer, name) for layer in model.layers for name in NORMS]
        self._cos_sin = model.cos_sin.contiguous()
        self._tensors = [self._cos_sin, *norms, *(t for _, tensors in weights for t in tensors)]
        self._weights = (step_layers.Weight * len(weights))(*(w for w, _ in weights))
        self._norms = _pointers(norms)

    @classmethod
    def build(cls, model: LlamaModel) -> StepLayers | None:
        """The model's layers for the C file, or None where it does not apply to this model."""
        layers = model.layers
        weights = [describe(getattr(layer, name)) for layer in layers for name in GEMMS]
        described = [w for w in weights if w is not None]
        applies = (  # the kernel is built last: only where the weights are on its kernels
            model.config.llama_layers  # plain Llama layers: no q/k norms, windows, soft-caps, GeGLU (Gemma, Qwen3)
            and model.dtype == torch.float32
            and all(layer.qkv_bias is None for layer in layers)
            and len(described) == len(weights)
            and step_layers.library() is not None
        )
        return cls(model, described) if applies else None

    def takes(self, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> bool:
        """Whether this step can run here: int64 positions and slots, an fp32 cache."""
        return (positions.dtype == torch.int64 and meta.slot_mapping.dtype == torch.int64
                and kv_cache.dtype == torch.float32)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, H] embeddings of the step's tokens -> (last layer's output [T, H], its residual [T, H])."""
        c = self.config
        h = h.contiguous()
        positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        tables, lens = _token_queries(meta)
        out, residual = torch.empty_like(h), torch.empty_like(h)
        with build.traced("cpu_step_layers"):
            rc = self._run(
                self.num_layers, h.shape[0], c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                c.intermediate_size, h.data_ptr(), out.data_ptr(), residual.data_ptr(),
                self._weights, self._norms,
                _pointers(kv_cache.k_caches), _pointers(kv_cache.v_caches),
                positions.data_ptr(), slots.data_ptr(), self._cos_sin.data_ptr(), int(c.rope_interleaved),
                tables.data_ptr(), tables.shape[1], lens.data_ptr(), kv_cache.k_caches[0].shape[1],
                c.head_dim**-0.5, c.rms_norm_eps, block_linear.threads_for(h.shape[0]),
            )
        if rc != 0:
            raise MemoryError("cpu step layers: no memory for the step's scratch")
        return out, residual


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def describe(weight: object) -> tuple[step_layers.Weight, list[object]] | None:
    """A GEMM weight as the C file takes it, and what it points into (tensors, part arrays: to keep alive);
    None for a weight on no C kernel (fp32, torch's int8, a fused weight with a part on neither)."""
    tensors: list[object]
    if isinstance(weight, BlockWeight):
        tensors = [t for t in (weight.codes, weight.scales, weight.offsets) if t is not None]
        return step_layers.Weight(step_layers.KINDS.index(weight.kind), weight.codes.data_ptr(), weight.scales.data_ptr(),
                                  _address(weight.offsets), None, None, weight.out_features), tensors
    if isinstance(weight, KQuantWeight):
        p = weight.packed
        tensors = [t for t in (p.codes, p.d, p.offset, p.sc, p.mn) if t is not None]
        return step_layers.Weight(step_layers.KINDS.index(p.kind), p.codes.data_ptr(), p.d.data_ptr(), p.offset.data_ptr(),
                                  _address(p.sc), _address(p.mn), weight.out_features), tensors
    if isinstance(weight, RowsWeight):
        described = [describe(part) for part in weight.parts]
        parts = [part for part in described if part is not None]
        if len(parts) < len(described):
            return None
        array = (step_layers.Weight * len(parts))(*(w for w, _ in parts))
        whole = step_layers.Weight(kind=step_layers.KINDS.index("parts"), rows=weight.out_features,
                                   num_parts=len(parts), parts=array)
        return whole, [array, *(kept for _, keep in parts for kept in keep)]
    return None


def _token_queries(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of the step as one query, prefill tokens first: block tables [T, max_blocks] and
    the context each sees [T], both int32 (a prefill token sees its sequence up to itself)."""
    tables, lens = meta.decode_block_tables.to(torch.int32), meta.decode_context_lens.to(torch.int32)
    if meta.num_prefills:
        prefill_tables, prefill_lens = paged_attention.prefill_token_queries(
            meta.prefill_block_tables, meta.prefill_query_start_loc, meta.prefill_context_lens)
        width = max(tables.shape[1], prefill_tables.shape[1])
        tables = torch.cat([F.pad(prefill_tables.to(torch.int32), (0, width - prefill_tables.shape[1])),
                            F.pad(tables, (0, width - tables.shape[1]))])
        lens = torch.cat([prefill_lens.to(torch.int32), lens])
    return tables.contiguous(), lens.contiguous()
