from dataclasses import dataclass

import pytest

from llmserve.runtime.settings import CommonSettings, SettingsError, require, setting


@dataclass
class ExampleSettings(CommonSettings):
    max_batch: int = setting(32, "sequences per batch")
    ratio: float = setting(0.5, "a fraction")
    enabled: bool = setting(False, "a switch")
    name: str | None = setting(None, "optional")

    def validate(self) -> None:
        super().validate()
        require(self.max_batch >= 1, "max_batch", "must be >= 1")


def test_defaults():
    s = ExampleSettings.load([], env={})
    assert (s.max_batch, s.ratio, s.enabled, s.name, s.port) == (32, 0.5, False, None, 0)


def test_flag_beats_env_beats_default():
    env = {"LLMSERVE_MAX_BATCH": "8", "LLMSERVE_RATIO": "0.25"}
    s = ExampleSettings.load(["--max-batch", "4"], env=env)
    assert s.max_batch == 4
    assert s.ratio == 0.25


def test_bool_and_optional_conversion():
    s = ExampleSettings.load(["--enabled", "yes", "--name", "x"], env={})
    assert s.enabled is True and s.name == "x"
    assert ExampleSettings.load([], env={"LLMSERVE_ENABLED": "off"}).enabled is False


def test_redis_url_alias_env():
    assert ExampleSettings.load([], env={"REDIS_URL": "redis://h:1/0"}).redis_url == "redis://h:1/0"
    both = {"REDIS_URL": "redis://a:1/0", "LLMSERVE_REDIS_URL": "redis://b:1/0"}
    assert ExampleSettings.load([], env=both).redis_url == "redis://b:1/0"


@pytest.mark.parametrize("argv, env, fragment", [
    (["--max-batch", "0"], {}, "max_batch: must be >= 1"),
    (["--max-batch", "many"], {}, "max_batch: 'many' is not a valid int"),
    ([], {"LLMSERVE_ENABLED": "maybe"}, "enabled: 'maybe' is not a valid bool"),
    (["--port", "70000"], {}, "port: must be in 0..65535"),
    (["--log-level", "loud"], {}, "log_level"),
    (["--redis-url", "http://x"], {}, "redis_url"),
    (["--tls-cert", "c.pem"], {}, "tls_cert and tls_key must be given together"),
])
def test_invalid_values_name_the_setting(argv, env, fragment):
    with pytest.raises(SettingsError) as err:
        ExampleSettings.load(argv, env=env)
    assert fragment in str(err.value)


def test_round_trip_through_flags_and_redaction():
    s = ExampleSettings.load(["--max-batch", "3", "--redis-password", "hunter2"], env={})
    again = ExampleSettings.load(s.to_flags(), env={})
    assert again == s
    assert s.redacted()["redis_password"] == "***"


def test_help_lists_env_names(capsys):
    with pytest.raises(SystemExit):
        ExampleSettings.load(["--help"], env={})
    out = capsys.readouterr().out
    assert "LLMSERVE_MAX_BATCH" in out and "--max-batch" in out


def test_load_or_exit_ends_with_code_2_and_the_reason(capsys):
    with pytest.raises(SystemExit) as exit_:
        ExampleSettings.load_or_exit(["--max-batch", "0"], prog="python -m example")
    assert exit_.value.code == 2
    assert "python -m example: error: invalid setting max_batch: must be >= 1" in capsys.readouterr().err
