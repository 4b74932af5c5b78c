"""tokenizer_svc settings and start-up errors (no server)."""

from __future__ import annotations

import pytest

from llmserve.runtime.settings import SettingsError
from tokenizer_svc.__main__ import main
from tokenizer_svc.config import TokenizerSettings


def test_flags_env_and_defaults():
    settings = TokenizerSettings.load(["--models", "a.gguf, b", "--workers", "3"], env={"LLMSERVE_MAX_MESSAGES": "7"})
    assert settings.model_specs() == ["a.gguf", "b"]
    assert (settings.pool_size(), settings.max_messages, settings.max_text_bytes) == (3, 7, 1 << 20)


@pytest.mark.parametrize("argv, name", [
    (["--workers", "-1"], "workers"),
    (["--models", " , "], "models"),
    (["--max-text-bytes", "0"], "max_text_bytes"),
    (["--max-text-bytes", "100000000"], "max_message_bytes"),
    (["--request-timeout-s", "0"], "request_timeout_s"),
])
def test_invalid_settings_name_the_setting(argv, name):
    with pytest.raises(SettingsError, match=f"invalid setting {name}"):
        TokenizerSettings.load(argv, env={})


def test_unloadable_model_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert main(["--models", str(bad), "--workers", "1"]) == 2
    assert main(["--models", str(tmp_path / "missing.gguf")]) == 2
    assert "cannot load model" in capsys.readouterr().err


def test_help_works(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--metrics-port", "--models", "--workers", "--max-text-bytes"):
        assert flag in out
