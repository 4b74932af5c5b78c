"""Fixtures of the CPU-executed kernel tests. Imports only torch, numpy and our ops (the GPU image,
where scripts/gpu_check.sh runs these too, lacks the service dependencies)."""

from __future__ import annotations

import os

import cpu_backend as cb
import pytest

from gpu_worker.ops.cuda import kernels
from gpu_worker.ops.cuda import ops as cuda

EXECUTED: set[str] = set()  # kernel variants launched in this session (reported at the end)


@pytest.fixture(scope="session")
def built() -> None:
    """Skips without g++; else every variant the worker can launch, compiled up front in parallel (cached across runs)."""
    reason = cb.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cb.build_all(kernels.KERNEL_DIR, kernels.launchable_kernels(), jobs=os.cpu_count() or 2)


@pytest.fixture
def launch_with(built):
    """launch_with(order, seed) -> a context manager routing gpu_worker.ops.cuda.ops through a CPU launcher."""
    launchers = []

    def make(order: cb.Order = cb.Order.FORWARD, seed: int = 0, **kwargs):
        launcher = cb.CpuLauncher(order=order, seed=seed, **kwargs)
        launchers.append(launcher)
        return cuda.use_launcher(launcher)

    yield make
    for launcher in launchers:
        EXECUTED.update(launcher.launched)


def pytest_terminal_summary(terminalreporter):
    if EXECUTED:
        every = {n for names in kernels.launchable_kernels().values() for n in names}
        missing = sorted(every - EXECUTED)
        terminalreporter.write_line(f"CPU-executed CUDA kernels: {len(EXECUTED & every)}/{len(every)} variants"
                                    + (f"; not run: {', '.join(missing[:8])}" if missing else ""))
