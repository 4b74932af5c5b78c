import pytest

from gpu_worker.config import WorkerSettings
from llmserve.runtime.settings import SettingsError


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


def test_scheduling_settings_reach_flags_and_env_and_are_checked():
    settings = WorkerSettings.load(["--aging-steps", "64", "--priority-preemption", "false"], env={})
    assert (settings.aging_steps, settings.priority_preemption) == (64, False)
    assert WorkerSettings.load([], env={"LLMSERVE_AGING_STEPS": "8"}).aging_steps == 8
    assert WorkerSettings.load([], env={}).aging_steps == 256
    with pytest.raises(SettingsError, match="aging_steps"):
        WorkerSettings.load(["--aging-steps", "0"], env={})


def test_speculation_is_auto_by_device_and_checked():
    auto = WorkerSettings.load([], env={})
    assert (auto.draft_tokens("cpu"), auto.draft_tokens("cuda"), auto.spec_max_running) == (3, 0, 1)
    assert auto.spec_max_temperature == 0.7
    with pytest.raises(SettingsError, match="spec_max_temperature"):
        WorkerSettings.load(["--spec-max-temperature", "-1"], env={})
    assert WorkerSettings.load(["--spec-tokens", "0"], env={}).draft_tokens("cpu") == 0
    assert WorkerSettings.load([], env={"LLMSERVE_SPEC_TOKENS": "5"}).draft_tokens("cuda") == 5
    with pytest.raises(SettingsError, match="spec_tokens"):
        WorkerSettings.load(["--spec-tokens", "17"], env={})
    with pytest.raises(SettingsError, match="spec_max_running"):
        WorkerSettings.load(["--spec-max-running", "0"], env={})
