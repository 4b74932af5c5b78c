"""What `llmserve up` prints (the Redis URL without its password) and the options it takes."""

import pytest

from llmserve.cli import build_parser, redact_url


def test_redis_url_is_printed_without_its_password():
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("rediss://user:s3cret@redis.example:6380/1") == "rediss://user:***@redis.example:6380/1"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_up_runs_valkey_with_everysec_unless_told_always():
    assert build_parser().parse_args(["up"]).redis_fsync == "everysec"
    assert build_parser().parse_args(["up", "--redis-fsync", "always"]).redis_fsync == "always"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--redis-fsync", "no"])
