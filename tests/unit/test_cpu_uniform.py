"""The sampler's uniform noise in C (gpu_worker/ops/cpu/uniform.c): torch.rand's own CPU stream, bit for bit."""

from __future__ import annotations

import shutil

import pytest
import torch

from gpu_worker.ops.cpu import uniform as cpu_uniform

needs_kernel = pytest.mark.skipif(shutil.which("cc") is None or cpu_uniform.library() is None,
                                  reason="no C compiler for the kernel")
SEEDS = [0, 1, 5489, 2**31, 2**32 - 1, 2**32, 2**40 + 7, (1 << 63) - 1]


def torch_rows(seeds: list[int], n: int) -> torch.Tensor:
    return torch.stack([torch.rand(n, generator=torch.Generator().manual_seed(seed)) for seed in seeds])


@needs_kernel
@pytest.mark.parametrize("n", [1, 7, 623, 624, 625, 1248, 32000, 49152, 151936])
def test_each_row_is_torch_rand_of_its_seed(n):
    assert torch.equal(cpu_uniform.uniform_rows(SEEDS, n), torch_rows(SEEDS, n))


@needs_kernel
def test_rows_do_not_depend_on_the_thread_count_or_the_other_rows(monkeypatch):
    seeds = list(range(100, 133))
    many = cpu_uniform.uniform_rows(seeds, 4099)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch.equal(cpu_uniform.uniform_rows(seeds, 4099), many)
    assert torch.equal(cpu_uniform.uniform_rows([seeds[7]], 4099)[0], many[7])


def test_without_the_kernel_torch_draws_the_same_rows(monkeypatch):
    monkeypatch.setattr(cpu_uniform, "library", lambda: None)
    assert torch.equal(cpu_uniform.uniform_rows(SEEDS, 1000), torch_rows(SEEDS, 1000))


def test_no_seeds_no_rows():
    assert cpu_uniform.uniform_rows([], 10).shape == (0, 10)


@needs_kernel
def test_a_wrong_stream_is_caught():
    """The check above can fail: a seed off by one gives another row."""
    assert not torch.equal(cpu_uniform.uniform_rows([6], 100), torch_rows([5], 100))
