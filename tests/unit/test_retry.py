import time
from types import SimpleNamespace

import grpc
import pytest
import redis.exceptions

from llmserve.runtime import retry
from llmserve.runtime.errors import InvalidArgument, Unavailable
from llmserve.runtime.retry import is_retryable, retrying, retrying_sync


class StatusError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


def test_retryable_classification():
    assert is_retryable(StatusError(grpc.StatusCode.UNAVAILABLE))
    assert not is_retryable(StatusError(grpc.StatusCode.INVALID_ARGUMENT))
    assert not is_retryable(StatusError(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert is_retryable(redis.exceptions.ConnectionError("down"))
    assert is_retryable(Unavailable("overloaded"))
    assert not is_retryable(InvalidArgument("prompt", "empty"))


@pytest.mark.parametrize("reply", ["OOM command not allowed when used memory > 'maxmemory'.",
                                   "READONLY You can't write against a read only replica.",
                                   "LOADING Valkey is loading the dataset in memory",
                                   "CLUSTERDOWN The cluster is down", "MASTERDOWN Link with MASTER is down",
                                   "TRYAGAIN Multiple keys request during rehashing of slot"])
def test_server_replies_that_mean_unavailable_are_retryable(reply):
    """As redis-py's parser turns each error reply into an exception (by its first word)."""
    from redis._parsers.base import BaseParser

    assert is_retryable(BaseParser.parse_error(reply))


def test_cluster_slot_map_gaps_are_retryable_and_wrong_commands_are_not():
    assert is_retryable(redis.exceptions.SlotNotCoveredError("slot 7 not covered"))
    assert not is_retryable(redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"))
    assert not is_retryable(redis.exceptions.NoScriptError("NOSCRIPT No matching script"))


def _sleeps_of(policy, failures):
    sleeps = []
    policy.sleep = sleeps.append  # record instead of sleeping
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] <= failures:
            raise Unavailable("down")
        return "ok"

    return policy(flaky), sleeps


def test_backoff_is_jittered_and_bounded_by_exponential_cap():
    result, sleeps = _sleeps_of(retrying_sync(max_attempts=10, initial_s=0.1, max_backoff_s=100), 6)
    assert result == "ok"
    assert len(sleeps) == 6
    for n, s in enumerate(sleeps, start=1):
        assert 0 <= s <= 0.1 * 2 ** n  # full jitter: uniform in [0, cap]
    _, again = _sleeps_of(retrying_sync(max_attempts=10, initial_s=0.1, max_backoff_s=100), 6)
    assert again != sleeps  # random, not a fixed schedule


def test_non_retryable_error_is_raised_at_once():
    policy = retrying_sync(max_attempts=5)
    calls = []

    def bad():
        calls.append(1)
        raise InvalidArgument("prompt", "empty")

    with pytest.raises(InvalidArgument):
        policy(bad)
    assert len(calls) == 1


def test_stops_at_the_deadline(monkeypatch):
    """On a clock that only the policy's sleeps move: the policy never schedules an attempt past the
    deadline. (On a real clock an OS that wakes a sleep late can still start one just past it; the
    caller's per-attempt timeout, remaining(deadline), bounds that attempt to a millisecond.)"""
    clock = {"now": 100.0}
    monkeypatch.setattr(retry, "time", SimpleNamespace(monotonic=lambda: clock["now"]))
    deadline = clock["now"] + 0.3
    policy = retrying_sync(deadline=deadline, max_attempts=1000, initial_s=0.02, max_backoff_s=0.05)
    policy.sleep = lambda seconds: clock.update(now=clock["now"] + seconds)
    calls = []

    def always_down():
        calls.append(clock["now"])
        clock["now"] += 0.001  # each attempt takes a millisecond
        raise Unavailable("down")

    with pytest.raises(Unavailable):
        policy(always_down)
    assert calls[-1] <= deadline  # never an attempt after the deadline
    assert len(calls) >= 2
    assert deadline - calls[-1] <= 0.05 + 0.001  # and it kept trying until the next sleep would cross it


async def test_async_policy_retries_then_succeeds():
    calls = []
    async for attempt in retrying(deadline=time.monotonic() + 5, initial_s=0.001):
        with attempt:
            calls.append(1)
            if len(calls) < 3:
                raise redis.exceptions.ConnectionError("down")
    assert len(calls) == 3
