"""The backend contract (gpu_worker/ops/backend.py): every backend has each member with the contract's
parameters, devices map to their backend, and ops/ stays below the model, runner and engine."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.ops import get_backend
from gpu_worker.ops.backend import Backend
from gpu_worker.ops.cpu.backend import CpuBackend
from gpu_worker.ops.cuda.backend import CudaBackend
from gpu_worker.ops.reference import ReferenceBackend

BACKENDS = [ReferenceBackend, CpuBackend, CudaBackend]
OPS_DIR = Path(__file__).resolve().parents[2] / "gpu_worker" / "ops"
CONFIG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, context_length=32)


def contract_members() -> dict[str, inspect.Signature]:
    """Each method of the contract -> its signature without `self`."""
    members = {}
    for name, member in vars(Backend).items():
        if callable(member) and not name.startswith("_"):
            members[name] = inspect.signature(member).replace(
                parameters=list(inspect.signature(member).parameters.values())[1:])
    return members


def test_the_contract_has_the_ops_and_weight_preparation():
    assert set(contract_members()) == {
        "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "write_kv_cache",
        "paged_decode_attention", "paged_prefill_attention", "compute_dtype", "logits_dtype", "runs_file_formats",
        "prepare_weights"}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_every_backend_takes_the_contracts_parameters(backend):
    instance = backend()
    assert instance.name in ("reference", "cpu", "cuda")
    for name, expected in contract_members().items():
        got = inspect.signature(getattr(instance, name))  # bound: no self, as the model calls it
        assert list(got.parameters) == list(expected.parameters), f"{backend.__name__}.{name}"


def test_devices_map_to_their_backend():
    assert isinstance(get_backend("cpu"), CpuBackend)
    assert isinstance(get_backend(torch.device("cuda", 1)), CudaBackend)  # the CUDA backend imports without a GPU
    assert get_backend("cpu") is get_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="no ops backend"):
        get_backend("meta")


def test_dtypes_are_the_backends_choice():
    assert CpuBackend().compute_dtype() == ReferenceBackend().compute_dtype() == torch.float32
    assert CpuBackend().logits_dtype(torch.bfloat16) == torch.float32  # bf16 logits flip greedy near-ties
    assert CudaBackend().logits_dtype(torch.bfloat16) == torch.bfloat16
    assert LlamaModel(CONFIG, "cpu", torch.bfloat16).lm_head_dtype == torch.float32


def test_only_the_cpu_backend_runs_a_gguf_files_own_formats_and_only_in_fp32():
    assert CpuBackend().runs_file_formats(torch.float32)  # the C kernels build on every CI machine
    assert not CpuBackend().runs_file_formats(torch.bfloat16)
    assert not ReferenceBackend().runs_file_formats(torch.float32)
    assert not CudaBackend().runs_file_formats(torch.bfloat16)


def test_weight_formats_a_backend_lacks_are_refused_before_any_weight_changes():
    model = LlamaModel(CONFIG, "cpu", torch.float32)
    before = model.layers[0].qkv_weight
    with pytest.raises(ValueError, match="no CUDA form"):
        CudaBackend().prepare_weights(model, "int4")
    with pytest.raises(ValueError, match="plain weights"):
        ReferenceBackend().prepare_weights(model, "int8")
    assert not ReferenceBackend().prepare_weights(model, "none") and not CudaBackend().prepare_weights(model, "none")
    assert model.layers[0].qkv_weight is before


def test_ops_import_no_model_runner_or_engine_module():
    for path in OPS_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                assert not name.startswith(("gpu_worker.model", "gpu_worker.runner", "gpu_worker.engine")), (
                    f"{path.relative_to(OPS_DIR)} imports {name}: ops/ sits below them")
