"""Every gpu_worker/ops/cuda/*.cu compiles with nvcc for sm_80 and sm_90 (no GPU needed).

The variants built are the ones `gpu_worker.ops.cuda.kernels.hot_name_expressions()` lists (at run time
NVRTC builds whichever a call needs). ptxas' register / spill / shared-memory report is printed
per kernel; the hot kernels must not spill. Skipped, with the reason shown, when nvcc is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpu_worker.ops.cuda import kernels

ARCHS = ("sm_80", "sm_90")


def _nvcc() -> str | None:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = _nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA kernels NOT compile-checked")

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(report: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {mangled kernel: {regs, stack, spill_stores, spill_loads, smem}}."""
    found: dict[str, dict[str, int]] = {}
    current = None
    for line in report.splitlines():
        if m := _ENTRY.search(line):
            current = found.setdefault(m.group(1), {"regs": 0, "stack": 0, "spill_stores": 0,
                                                    "spill_loads": 0, "smem": 0})
        elif current is not None and (m := _SPILL.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _REGS.search(line)):
            current["regs"] = int(m.group(1))
            if s := _SMEM.search(line):
                current["smem"] = int(s.group(1))
    return found


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=False).stdout
    lines = [line.split("(")[0].removeprefix("void ") for line in out.splitlines()]  # drop parameter lists
    return lines if len(lines) == len(names) else names


def _translation_unit(cu_file: Path, expressions: list[str]) -> str:
    """Include the kernel file and take each variant's address in host code: that instantiates it."""
    keep = ",\n".join(f"  (void*)&{e}" for e in expressions)
    return f'#include "{cu_file}"\nvoid* llmserve_keep[] = {{\n{keep}\n}};\n'


def compile_report(cu_file: Path, expressions: list[str], arch: str, tmp_path: Path) -> dict[str, dict[str, int]]:
    tu = tmp_path / f"{cu_file.stem}_{arch}.cu"
    tu.write_text(_translation_unit(cu_file, expressions))
    cmd = [NVCC, "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(tu.with_suffix(".cubin")),
           str(tu)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"nvcc failed for {cu_file.name} ({arch}):\n{proc.stderr}"
    return parse_ptxas(proc.stderr + proc.stdout)


def test_every_kernel_file_has_compiled_variants():
    files = {p.name for p in kernels.KERNEL_DIR.glob("*.cu")}
    assert files == set(kernels.hot_name_expressions()), "each .cu needs entries in hot_name_expressions()"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", sorted(kernels.hot_name_expressions()))
def test_compiles_without_spills(filename, arch, tmp_path, capsys):
    expressions = kernels.hot_name_expressions()[filename]
    report = compile_report(kernels.KERNEL_DIR / filename, expressions, arch, tmp_path)
    assert len(report) == len(expressions), f"expected {len(expressions)} kernels, ptxas built {sorted(report)}"
    names = _demangle(sorted(report))
    with capsys.disabled():
        print(f"\n[{arch}] {filename}")
        for mangled, name in zip(sorted(report), names):
            r = report[mangled]
            print(f"  regs={r['regs']:3d} spill_st={r['spill_stores']:3d}B spill_ld={r['spill_loads']:3d}B "
                  f"stack={r['stack']:3d}B smem={r['smem']:5d}B  {name}")
    spilling = {n: r for n, r in zip(names, (report[m] for m in sorted(report))) if r["spill_stores"] or r["spill_loads"]}
    assert not spilling, f"kernels spill registers on {arch}: {spilling}"


def test_parse_ptxas_reads_registers_and_spills():
    text = (
        "ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1kPf\n"
        "    16 bytes stack frame, 24 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size, 16640 bytes smem\n"
    )
    assert parse_ptxas(text) == {"_Z1kPf": {"regs": 255, "stack": 16, "spill_stores": 24, "spill_loads": 12,
                                            "smem": 16640}}
