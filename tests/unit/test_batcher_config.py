"""BatcherSettings: flags, env, per-model overrides, validation."""

from __future__ import annotations

import pytest

from batcher.config import BatcherSettings, BatchLimits
from llmserve.runtime.settings import SettingsError


def test_flags_and_per_model_overrides(tmp_path):
    f = tmp_path / "limits.yaml"
    f.write_text("big:\n  max_batch: 4\n  prefill_token_budget: 1000\n")
    s = BatcherSettings.load(["--models", "small, big", "--max-batch", "16", "--max-wait-ms", "7",
                              "--model-overrides", f"@{f}"], env={})
    assert s.model_list() == ["small", "big"]
    assert s.limits_for("small") == BatchLimits(16, 7.0, 8192)
    assert s.limits_for("big") == BatchLimits(4, 7.0, 1000)


def test_inline_json_override_and_env():
    s = BatcherSettings.load(["--model-overrides", '{"m": {"max_wait_ms": 50}}'],
                             env={"LLMSERVE_MODELS": "m", "LLMSERVE_MAX_BATCH": "3"})
    assert s.limits_for("m") == BatchLimits(3, 50.0, 8192)


@pytest.mark.parametrize("argv, fragment", [
    (["--max-batch", "0"], "max_batch"),
    (["--model-overrides", '{"m": {"max_batch": 0}}', "--models", "m"], "max_batch (m)"),
    (["--model-overrides", '{"m": {"batch": 3}}'], "unknown keys"),
    (["--model-overrides", "[1, 2]"], "mapping"),
    (["--models", " , "], "models"),
    (["--decode-reserve", "1.5"], "decode_reserve"),
])
def test_bad_settings_name_the_setting(argv, fragment):
    with pytest.raises(SettingsError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        BatcherSettings.load(argv, env={})


def test_consumer_names_are_unique_unless_given():
    s = BatcherSettings.load([], env={})
    assert s.consumer_name() != s.consumer_name()
    assert BatcherSettings.load(["--consumer", "b7"], env={}).consumer_name() == "b7"
