"""Opt-in (make test-kernels-asan): an out-of-bounds access in a kernel is reported by AddressSanitizer
with the .cu line. Each case runs in a child process, since ASan ends the process it reports in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import cpu_backend as cb
import pytest

pytestmark = pytest.mark.skipif(not cb.asan_enabled(), reason="opt-in: make test-kernels-asan")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

PROBE_OOB = """
import numpy as np, torch
import cpu_backend as cb
out = torch.zeros(64)
cb.CpuLauncher(kernel_dir=cb.Path(HERE), variants={"probe_kernels.cu": ["probe::out_of_bounds_kernel"]}).launch(
    "probe_kernels.cu", "probe::out_of_bounds_kernel", (1,), (32,), (out, np.int32(64)))
"""

DECODE_OOB = """
import torch
import cpu_backend as cb
from gpu_worker.ops.cuda import kernels
from gpu_worker.ops.cuda import ops as cuda
from kernel_cases import paged_batch
q, kc, vc, tables, ctx = paged_batch([40], 4, 1, 64, torch.float16)
tables[0, 1] = kc.shape[0]  # one block past the cache
with cuda.use_launcher(cb.CpuLauncher()):
    cuda.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
"""


def run_child(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", f"HERE = {str(HERE)!r}\n{code}"], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode != 0, "the out-of-bounds access went unreported"
    return proc.stderr


def source_line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_asan_names_the_line_of_an_out_of_bounds_write():
    report = run_child(PROBE_OOB)
    line = source_line(HERE / "probe_kernels.cu", "out[n] = 1.f;")
    assert re.search(rf"SUMMARY: AddressSanitizer: heap-buffer-overflow .*probe_kernels\.cu:{line}\b", report), report


def test_asan_names_the_kernel_lines_of_a_block_table_past_the_cache():
    report = run_child(DECODE_OOB)
    assert "heap-buffer-overflow" in report and "READ of size 16" in report, report
    line = source_line(cb.kernels.KERNEL_DIR / "paged_attention.cu", "dst[j][v] = valid ? load_chunk(")
    assert re.search(rf"paged_attention\.cu:{line}\b", report), report
