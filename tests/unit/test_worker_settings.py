import pytest

from gpu_worker.config import WorkerSettings
from llmserve.settings import SettingsError


def test_admin_address_never_advertises_a_wildcard_bind():
    assert WorkerSettings.load(["--host", "10.1.2.3", "--port", "5"], env={}).admin_address() == "10.1.2.3:5"
    wildcard = WorkerSettings.load(["--host", "0.0.0.0", "--port", "5"], env={}).admin_address()
    assert wildcard.endswith(":5") and not wildcard.startswith("0.0.0.0")


def test_cuda_graph_batch_sizes():
    assert WorkerSettings.load(["--cuda-graph-batch-sizes", "1, 8,32"], env={}).graph_batch_sizes() == [1, 8, 32]
    assert WorkerSettings.load(["--cuda-graph-batch-sizes", ""], env={}).graph_batch_sizes() == []
    with pytest.raises(SettingsError, match="cuda_graph_batch_sizes"):
        WorkerSettings.load(["--cuda-graph-batch-sizes", "1,x"], env={})


def test_quantization_defaults_to_auto_and_takes_the_known_formats():
    assert WorkerSettings.load([], env={}).quantization == "auto"
    assert WorkerSettings.load(["--quantization", "int4"], env={}).quantization == "int4"
    assert WorkerSettings.load([], env={"LLMSERVE_QUANTIZATION": "int8"}).quantization == "int8"
    with pytest.raises(SettingsError, match="quantization"):
        WorkerSettings.load(["--quantization", "fp8"], env={})
