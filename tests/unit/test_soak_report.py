"""Soak findings from samples: what counts as growth or a leak."""

from __future__ import annotations

from llmserve.loadgen.soak import MB, Sample, SoakConfig, SoakReport


def sample(t=0.0, rss=200 * MB, fds=40, memory=2 * MB, keys=10, request_keys=6, no_ttl=0) -> Sample:
    return Sample(t_s=t, rss_bytes={"gateway-0": rss}, fds={"gateway-0": fds}, redis_used_memory=memory,
                  redis_keys=keys, request_keys=request_keys, request_keys_without_ttl=no_ttl)


def report(samples, after=None, codes=None, streams=None) -> SoakReport:
    return SoakReport(config=SoakConfig(), samples=samples, summary={"codes": codes or {"OK": 10}},
                      before=sample(request_keys=0), after_expiry=after or sample(request_keys=0),
                      stream_lengths=streams or {})


def steady(n=8, **last) -> list[Sample]:
    return [sample(t=5.0 * i) for i in range(n - 1)] + [sample(t=5.0 * n, **last)]


def test_steady_run_has_no_problems():
    assert report(steady(rss=200 * MB + 40 * MB, fds=50)).problems() == []


def test_rss_growth_beyond_slack_is_reported():
    problems = report(steady(rss=200 * MB + 65 * MB)).problems()
    assert problems == ["gateway-0: RSS grew 65.0 MB (from 200.0 MB)"]


def test_growth_is_measured_after_the_warmup():
    samples = [sample(t=0, rss=50 * MB)] + steady(7, rss=250 * MB)[1:]   # warm-up climb from 50 MB is fine
    samples[1] = sample(t=5, rss=230 * MB)
    samples[2] = sample(t=10, rss=230 * MB)
    assert report(samples).problems() == []


def test_fd_growth_and_errors_are_reported():
    problems = report(steady(fds=40 + 17), codes={"OK": 8, "UNAVAILABLE": 2}).problems()
    assert problems == ["failed requests under moderate load: {'UNAVAILABLE': 2}",
                        "gateway-0: open fds grew from 40 to 57"]


def test_redis_leaks_are_reported():
    samples = steady()
    samples[3] = sample(t=15, no_ttl=2)
    problems = report(samples, after=sample(request_keys=3, memory=2 * MB + 17 * MB),
                      streams={"llmserve:{m:x}:work:normal": 4, "llmserve:{m:x}:inbox:w0": 0}).problems()
    assert problems == ["2 per-request keys without a TTL at t=15s",
                        "3 per-request keys left after the TTL passed",
                        "Redis memory grew 17.0 MB after the per-request keys expired",
                        "stream llmserve:{m:x}:work:normal still holds 4 entries"]
