#!/usr/bin/env bash
# One prepared GPU check (issue 7): GPU tests, then the kernel benchmark; everything under $OUT.
# Installs nothing and needs no network. Run from the repo root on a machine with one GPU:
#   OUT=/some/dir scripts/gpu_check.sh
# Budget: under 8 minutes on one H200: tests capped at 270 s (incl. NVRTC compiles), bench at 180 s.
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

timeout 180 "$PY" bench/kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== tests rc=$tests_rc bench rc=$bench_rc" | tee -a "$OUT/env.log"
exit $(( tests_rc != 0 || bench_rc != 0 ))
