#!/usr/bin/env bash
# One prepared GPU check (issues 7, 14, 15): GPU tests, the same kernels executed on the CPU (tests/cuda_cpu,
# so both runs are of one commit), then the kernel benchmark; everything under $OUT. Every .cu file in
# gpu_worker/ops/cuda/ is covered by all three, the weight-only int8 decode GEMV (int8_gemv.cu) included:
# tests/gpu/test_kernels_gpu.py::test_int8_linear*, test_engine_gpu.py::test_int8_weights_*, and the
# int8-vs-bf16-cuBLAS section of bench/kernels.py.
# Installs nothing and needs no network. Run from the repo root on a machine with one GPU:
#   OUT=/some/dir scripts/gpu_check.sh
# Budget: under 10 minutes on one H200: GPU tests capped at 270 s (incl. NVRTC compiles), CPU-executed
# kernels at 150 s (g++ builds in parallel; skipped with the reason where g++ is missing), bench at 180 s,
# the roofline probe at 60 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

{
  echo "== $(date -u +%FT%TZ) gpu_check on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  "$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| cupy', cupy.__version__)" 2>&1
} | tee "$OUT/env.log"

# GPU tests. --confcutdir keeps pytest from loading tests/conftest.py (it imports redis, absent here);
# -p no:cacheprovider avoids writing .pytest_cache into the tree.
timeout 270 "$PY" -m pytest tests/gpu -m gpu -q -rs --confcutdir=tests/gpu -p no:cacheprovider \
  -o addopts="" --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

timeout 150 "$PY" -m pytest tests/cuda_cpu -q -rs --confcutdir=tests/cuda_cpu -p no:cacheprovider \
  -o addopts="" --junitxml="$OUT/junit_cuda_cpu.xml" 2>&1 | tee "$OUT/pytest_cuda_cpu.log"
cpu_rc=${PIPESTATUS[0]}

timeout 180 "$PY" bench/kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

# The roofline meter's probe (gpu_worker/roofline.py): device-to-device copy bandwidth, the reference of a
# CUDA worker's llmserve_worker_bandwidth_fraction (tests/gpu/test_roofline_gpu.py checks it too).
timeout 60 "$PY" -c "from gpu_worker.roofline import probe_bandwidth; print(probe_bandwidth('cuda'))" 2>&1 \
  | tee "$OUT/roofline_probe.log"
probe_rc=${PIPESTATUS[0]}

echo "== tests rc=$tests_rc cpu-kernel tests rc=$cpu_rc bench rc=$bench_rc roofline probe rc=$probe_rc" \
  | tee -a "$OUT/env.log"
exit $(( tests_rc != 0 || cpu_rc != 0 || bench_rc != 0 || probe_rc != 0 ))
