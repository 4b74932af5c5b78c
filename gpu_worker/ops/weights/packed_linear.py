"""Linear layers on CPU through oneDNN with weights reordered ("prepacked") once at load time.

Plain `F.linear` on CPU hands every call to MKL sgemm, which re-packs the whole weight matrix
for small M (a decode step's M is the number of running sequences), so a decode step streams
its weights far below the memory's bandwidth. oneDNN with the weight already in its blocked
layout skips that copy, and steps of one row and of many run faster (`python -m bench.engine`,
docs/performance.md).

The layout is chosen for `BATCH_HINT` rows. For M >= 2, oneDNN computes every row of a given
weight the same way whatever M is; a single row takes a different reduction order for some
shapes (SmolLM2's down projection), so it is computed as two. Each row's result is then the
same bits alone, in a decode batch or in a prefill chunk (tests/unit/test_packed_linear.py),
and a sequence's logits do not depend on what it is batched with. Plain MKL `F.linear` gives
no such guarantee: its M = 1 rows differ in the last bits from the same rows in a batch.

PyTorch exposes this through the ops its inductor CPU backend uses
(`torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`); where a build or CPU
cannot run them (`available`), weights stay plain and `F.linear` runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from gpu_worker.ops.weights.quantized_linear import QuantizedWeight

BATCH_HINT = 16  # rows the blocked layout is tuned for; any M works


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """True where this torch build and CPU can prepack `dtype` weights (tried once on a tiny one)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        linear(torch.ones(1, 4, dtype=dtype), pack(torch.ones(2, 4, dtype=dtype)))
    except (AttributeError, RuntimeError):  # op missing from this build, or dtype unsupported on this CPU
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A CPU weight [N, K] (fp32 or bf16) -> an opaque oneDNN tensor for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear that also takes a weight made by `pack` or a quantized one. x: [T, K] -> [T, N]."""
    if isinstance(weight, QuantizedWeight):
        return weight.forward(x, bias)  # not through Module.__call__: no hooks here, and its dispatch is paid per GEMM
    if weight.is_mkldnn:
        rows = x.shape[0]
        if rows == 1:
            x = x.expand(2, -1).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out[:1] if rows == 1 else out
    return F.linear(x, weight, bias)
