"""Building and loading the CPU C kernels (gpu_worker/ops/cpu/build.py)."""

from __future__ import annotations

import shutil

import pytest
from structlog.testing import capture_logs

from gpu_worker.ops.cpu import build as cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache dir and a cleared load cache (restored afterwards for the other tests)."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cpu_kernels.load.cache_clear()
    yield tmp_path / "cache" / "cpu_kernels"
    cpu_kernels.load.cache_clear()


def test_prebuilt_kernels_load_without_a_compiler(fresh, monkeypatch):
    with capture_logs() as logs:
        assert cpu_kernels.main() == 0  # what the container image runs at build time
    built = sorted(p.name for p in fresh.iterdir())
    assert [name.rsplit("-", 1)[0] for name in built] == sorted(
        f"{kernel}-{isa}" for kernel in cpu_kernels.KERNELS for isa in cpu_kernels.ISAS)
    paths = [log["path"] for log in logs if log["event"] == "cpu kernel built"]
    assert len(paths) == len(built) and all(str(fresh) in path for path in paths)
    assert [log for log in logs if log["event"] == "cpu kernel compiler warnings"] == []  # every variant compiles clean
    cpu_kernels.load.cache_clear()
    monkeypatch.setenv("CC", "/nonexistent/cc")  # the runtime image has no compiler
    assert all(cpu_kernels.load(name) is not None for name in cpu_kernels.KERNELS)


def test_without_a_compiler_or_a_prebuilt_file_the_caller_falls_back(fresh, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_kernels.load("layer_ops") is None
    assert not fresh.exists() or not any(fresh.iterdir())


def test_a_kernel_that_does_not_compile_falls_back_and_leaves_no_file(fresh, monkeypatch, tmp_path):
    broken = tmp_path / "cpu_broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernels, "__file__", str(broken))  # kernels are found beside the module
    assert cpu_kernels.load("cpu_broken") is None
    assert not fresh.exists() or not any(fresh.iterdir())
