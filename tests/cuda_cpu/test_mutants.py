"""The CPU-executed kernel checks bite: one-line bugs planted in copies of the real kernels (a missing
__syncthreads, a warp reduction one step short, a split-K reduce reading an unwritten partial, an
off-by-one on the last block) must each fail them; the unchanged copy must pass."""

from __future__ import annotations

from pathlib import Path

import cpu_backend as cb
import pytest
import torch
from kernel_cases import ORDERS, TOL, bits, fp32_oracle, paged_batch, rand

from gpu_worker.ops import reference
from gpu_worker.ops.cuda import kernels
from gpu_worker.ops.cuda import ops as cuda

DTYPE = torch.bfloat16
HEAD_DIM = 64
# Only the variants the checks below launch: a mutant build stays a few seconds.
VARIANTS = {
    "paged_attention.cu": [kernels.decode_kernel_name(DTYPE, HEAD_DIM, 16, 4), kernels.reduce_kernel_name(DTYPE, HEAD_DIM)],
    "layernorm.cu": [kernels.norm_kernel_name(fused, DTYPE, DTYPE, 8, warps) for fused in (False, True) for warps in (4, 8)],
}
DECODE, NORMS = "paged_attention.cu", "layernorm.cu"  # which check (and build) a mutant needs

# (name, file, line as written, line as mutated, kernel file whose check must catch it)
MUTANTS = [
    ("block_sum without its first __syncthreads", "common.cuh",
     "  if (lane == 0) red[warp] = x;\n  __syncthreads();\n", "  if (lane == 0) red[warp] = x;\n", NORMS),
    ("decode warps merged without the barrier", "paged_attention.cu",
     "  __syncthreads();\n\n  // Stage 5", "\n  // Stage 5", DECODE),
    ("warp_sum one step short", "common.cuh",
     "for (int mask = WIDTH / 2; mask >= 1; mask /= 2) x +=", "for (int mask = WIDTH / 2; mask >= 2; mask /= 2) x +=",
     NORMS),
    ("token groups merged one step short", "paged_attention.cu",
     "for (int mask = L; mask < WARP_SIZE; mask *= 2)", "for (int mask = L; mask < WARP_SIZE / 2; mask *= 2)", DECODE),
    ("split-K reduce reads partitions nobody wrote", "paged_attention.cu",
     "const int used = min(num_partitions, (context_lens[seq] + partition_tokens - 1) / partition_tokens);",
     "const int used = num_partitions;", DECODE),
    ("partial last block dropped", "paged_attention.cu",
     "const int ctx_blocks = (context_len + BLOCK_SIZE - 1) / BLOCK_SIZE;", "const int ctx_blocks = context_len / BLOCK_SIZE;",
     DECODE),
    ("one token past the context scored", "paged_attention.cu",
     "(first_token + tg + j * TPW < context_len) ? dot : neg_inf", "(first_token + tg + j * TPW <= context_len) ? dot : neg_inf",
     DECODE),
]


def mutant_dir(name: str, file: str | None, old: str, new: str) -> Path:
    """A copy of gpu_worker/ops/cuda with one edit, at a stable path (so its build is cached)."""
    root = cb.cache_dir() / "mutants" / name.replace(" ", "_").replace("/", "_")
    root.mkdir(parents=True, exist_ok=True)
    for src in sorted({*kernels.KERNEL_DIR.glob("*.cu"), *kernels.KERNEL_DIR.glob("*.cuh")}):  # the kernels, not ops.py
        text = src.read_text()
        if src.name == file:
            assert text.count(old) == 1, f"mutation site of {name!r} not found once in {file}"
            text = text.replace(old, new)
        if not (root / src.name).exists() or (root / src.name).read_text() != text:
            (root / src.name).write_text(text)
    return root


def _decode_check() -> object:
    lens = [1, 17, 600, 40]  # split-K over 3 partitions, empty trailing ones, partial last blocks
    q, kc, vc, tables, ctx = paged_batch(lens, 8, 2, HEAD_DIM, DTYPE)
    got = cuda.paged_decode_attention(q, kc, vc, tables, ctx, HEAD_DIM**-0.5)
    torch.testing.assert_close(got, fp32_oracle(reference.paged_decode_attention, q, kc, vc, tables, ctx,
                                                HEAD_DIM**-0.5), **TOL[DTYPE])
    return got


def _norm_check() -> object:
    outs = []
    for hidden in (576, 2048):  # 4 and 8 warps
        x, res, w = (rand(3, hidden, dtype=DTYPE, seed=s) for s in (1, 2, 3))
        w = w[0]
        outs.append(cuda.rms_norm(x, w, 1e-5))
        torch.testing.assert_close(outs[-1], reference.rms_norm(x, w, 1e-5), **TOL[DTYPE])
        got_n, got_r = cuda.fused_add_rms_norm(x, res, w, 1e-5)
        torch.testing.assert_close(got_n, reference.fused_add_rms_norm(x, res, w, 1e-5)[0], **TOL[DTYPE])
        outs += [got_n, got_r]
    return outs


CHECKS = {DECODE: _decode_check, NORMS: _norm_check}


def failures(kernel_dir: Path, files: tuple[str, ...] = (DECODE, NORMS)) -> list[str]:
    """Run the checks of `files` on the kernels in kernel_dir in every order; what failed, and how."""
    found = []
    for check in (CHECKS[f] for f in files):
        results = []
        for order, seed in ORDERS:
            launcher = cb.CpuLauncher(order, seed, kernel_dir=kernel_dir, variants=VARIANTS)
            try:
                with cuda.use_launcher(launcher):
                    results.append(check())
            except (AssertionError, cb.KernelError) as exc:
                found.append(f"{check.__name__} in {order.name} order: {str(exc).splitlines()[0]}")
        flat = [[bits(t) for t in (r if isinstance(r, list) else [r])] for r in results]
        if any(any(not torch.equal(a, b) for a, b in zip(f, flat[0])) for f in flat[1:]):
            found.append(f"{check.__name__}: result depends on the thread/block order")
    return found


@pytest.fixture(scope="module")
def compiled(built):
    """Build the unchanged copy and every mutant in parallel up front."""
    cb.build_all(mutant_dir("unchanged", None, "", ""), VARIANTS)
    for name, file, old, new, caught_by in MUTANTS:
        cb.build_all(mutant_dir(name, file, old, new), {caught_by: VARIANTS[caught_by]})


def test_unchanged_copy_passes(compiled):
    assert failures(mutant_dir("unchanged", None, "", "")) == []


@pytest.mark.parametrize(("name", "file", "old", "new", "caught_by"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_every_mutant_fails(compiled, name, file, old, new, caught_by):
    found = failures(mutant_dir(name, file, old, new), (caught_by,))
    assert found, f"mutant survived: {name}"
    print(f"{name}: {found[0]}")
