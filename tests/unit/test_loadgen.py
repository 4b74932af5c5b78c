"""Load generator: workload generation, statistics, reports, and the runners against an in-process servicer."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from llmserve.loadgen import main, report
from llmserve.loadgen.goodput import jain, summarize_goodput
from llmserve.loadgen.runner import RunSettings, build_request, run_closed, run_open
from llmserve.loadgen.stats import RequestResult, distribution, percentile, summarize
from llmserve.loadgen.workload import (
    DistError,
    LengthDist,
    WorkloadConfig,
    build_workload,
    parse_dist,
    poisson_arrivals,
)
from llmserve.protocol.slo import Targets
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc


def make_config(**overrides) -> WorkloadConfig:
    base = dict(requests=50, prompt_tokens=parse_dist("uniform:4:12"), output_tokens=parse_dist("8"),
                api_keys=["key-a", "key-b"], seed=3)
    return WorkloadConfig(**{**base, **overrides})


def make_result(code="OK", start=0.0, times=(), tokens=(), tenant=0) -> RequestResult:
    times, tokens = list(times), list(tokens)
    return RequestResult(tenant=tenant, code=code, start_s=start, end_s=times[-1] if times else start + 1.0,
                         first_token_s=times[0] if times else None, chunk_times_s=times, chunk_tokens=tokens)


# -- length distributions ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec, expected", [
    ("64", LengthDist("const", (64.0,))),
    ("const:7", LengthDist("const", (7.0,))),
    ("uniform:16:128", LengthDist("uniform", (16.0, 128.0))),
    ("normal:64:8", LengthDist("normal", (64.0, 8.0))),
    ("EXP:32", LengthDist("exp", (32.0,))),
])
def test_parse_dist_forms(spec, expected):
    assert parse_dist(spec) == expected


@pytest.mark.parametrize("spec", ["", "zero:1", "uniform:5", "uniform:9:3", "0", "exp:-1", "normal:4:-1",
                                  "uniform:a:b", "nan", "inf"])
def test_parse_dist_rejects(spec):
    with pytest.raises(DistError):
        parse_dist(spec)


def test_samples_stay_in_range_and_are_at_least_one():
    rng = random.Random(0)
    assert {parse_dist("5").sample(rng) for _ in range(20)} == {5}
    uniform = [parse_dist("uniform:3:6").sample(rng) for _ in range(500)]
    assert set(uniform) == {3, 4, 5, 6}
    assert min(parse_dist("normal:2:50").sample(rng) for _ in range(500)) == 1
    assert parse_dist("uniform:16:128").mean() == 72


# -- workload ----------------------------------------------------------------------------------------
def test_workload_is_reproducible_from_its_seed():
    assert build_workload(make_config()) == build_workload(make_config())
    assert build_workload(make_config()) != build_workload(make_config(seed=4))


def test_workload_fields_are_consistent():
    specs = build_workload(make_config())
    assert [s.seq for s in specs] == list(range(50))
    for s in specs:
        assert s.api_key == ["key-a", "key-b"][s.tenant]
        assert len(s.prompt.split()) == s.prompt_words and 4 <= s.prompt_words <= 12
        assert s.max_new_tokens == 8
    assert {s.tenant for s in specs} == {0, 1}
    assert len({s.seed for s in specs}) == 50


def test_tenant_weights_split_the_traffic():
    specs = build_workload(make_config(requests=400, tenant_weights=[3.0, 1.0]))
    share_a = sum(s.tenant == 0 for s in specs) / 400
    assert 0.68 < share_a < 0.82
    only_b = build_workload(make_config(tenant_weights=[0.0, 1.0]))
    assert {s.api_key for s in only_b} == {"key-b"}
    with pytest.raises(ValueError):
        build_workload(make_config(tenant_weights=[1.0]))


def test_poisson_arrivals_increase_with_the_right_mean_gap():
    times = poisson_arrivals(rate=4.0, count=4000, rng=random.Random(1))
    assert all(b > a for a, b in zip(times, times[1:]))
    assert times[0] > 0
    assert 0.95 * 0.25 < times[-1] / 4000 < 1.05 * 0.25
    assert poisson_arrivals(2.0, 10, random.Random(5)) == poisson_arrivals(2.0, 10, random.Random(5))
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 3, random.Random(0))


# -- statistics --------------------------------------------------------------------------------------
def test_percentile_interpolates_between_ranks():
    assert percentile([5, 1, 4, 2, 3], 50) == 3
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile(list(range(101)), 99) == 99
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_distribution_of_empty_sample():
    assert distribution([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_inter_token_latency_splits_a_gap_over_the_tokens_that_share_it():
    r = make_result(start=0.0, times=[1.0, 1.5, 2.5], tokens=[1, 1, 2])
    assert r.ttft_s == 1.0 and r.e2e_s == 2.5 and r.output_tokens == 4
    assert r.inter_token_s() == [0.5, 0.5, 0.5]
    together = make_result(times=[0.4], tokens=[3])
    assert together.inter_token_s() == [0.0, 0.0]
    assert make_result(code="UNAVAILABLE").inter_token_s() == []


def test_summarize_counts_codes_and_uses_only_successes_for_latency():
    results = [
        make_result(start=0.0, times=[1.0, 2.0], tokens=[1, 1], tenant=0),
        make_result(start=0.0, times=[3.0, 4.0, 5.0], tokens=[1, 1, 1], tenant=1),
        make_result(code="RESOURCE_EXHAUSTED", tenant=1),
        make_result(code="UNAVAILABLE", tenant=0),
        make_result(code="UNAVAILABLE", tenant=1),
    ]
    s = summarize(results, wall_s=10.0)
    assert s["requests"] == 5 and s["ok"] == 2
    assert s["codes"] == {"OK": 2, "RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 2}
    assert s["by_tenant"] == {"0": {"OK": 1, "UNAVAILABLE": 1}, "1": {"OK": 1, "RESOURCE_EXHAUSTED": 1,
                                                                      "UNAVAILABLE": 1}}
    assert s["ttft_s"]["count"] == 2 and s["ttft_s"]["p50"] == 2.0
    assert s["e2e_s"]["p50"] == 3.5
    assert s["inter_token_s"]["count"] == 3 and s["inter_token_s"]["p99"] == 1.0
    assert s["throughput"]["requests_per_s"] == 0.2
    assert s["throughput"]["output_tokens_per_s"] == 0.5 and s["throughput"]["output_tokens"] == 5


# -- reports -----------------------------------------------------------------------------------------
def sample_levels() -> list[dict]:
    ok = [make_result(start=0.0, times=[0.1 * c, 0.2 * c], tokens=[1, 1]) for c in (1, 2, 4)]
    return [{"load": c, "label": f"c={c}", "summary": summarize([r, make_result(code="UNAVAILABLE")], 2.0)}
            for c, r in zip((1, 2, 4), ok)]


def test_table_has_a_row_per_level_with_errors(tmp_path):
    lines = report.format_table(sample_levels()).splitlines()
    assert len(lines) == 4 and lines[0].split()[0] == "load"
    assert lines[1].split()[0] == "c=1" and lines[1].split()[1] == "1/2"
    assert lines[3].endswith("UNAVAILABLE=1")


def test_json_and_png_are_written(tmp_path):
    levels = sample_levels()
    report.write_json(tmp_path / "out" / "r.json", {"levels": levels})
    assert json.loads((tmp_path / "out" / "r.json").read_text())["levels"][2]["load"] == 4
    report.plot_latency(tmp_path / "r.png", levels, "closed")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_usage_before_sending(capsys):
    assert main(["--target", "127.0.0.1:1", "--prompt-tokens", "uniform:9:1", "--no-progress"]) == 2
    assert main(["--target", "127.0.0.1:1", "--concurrency", "0,4", "--no-progress"]) == 2
    assert main(["--target", "127.0.0.1:1", "--api-key", "a", "--tenant-weights", "1,2", "--no-progress"]) == 2
    assert "error" in capsys.readouterr().err


def test_request_is_built_as_prompt_or_chat():
    spec = build_workload(make_config(requests=1))[0]
    plain = build_request(spec, RunSettings(target="x", temperature=0.5, model="m"))
    assert plain.prompt == spec.prompt and not plain.messages and plain.model == "m"
    assert plain.sampling.max_new_tokens == 8 and plain.sampling.seed == spec.seed
    assert plain.sampling.temperature == 0.5
    chat = build_request(spec, RunSettings(target="x", chat=True))
    assert chat.prompt == "" and chat.messages[0].content == spec.prompt and chat.messages[0].role == "user"


# -- runners against an in-process Inference servicer ------------------------------------------------
class EchoInference(inference_pb2_grpc.InferenceServicer):
    """Streams max_new_tokens one-token messages; rejects key "bad"; tracks concurrency."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls = 0

    async def Generate(self, request, context):
        if dict(context.invocation_metadata()).get("authorization") == "Bearer bad":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown api key")
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for i in range(request.sampling.max_new_tokens):
                await asyncio.sleep(0.01)
                last = i == request.sampling.max_new_tokens - 1
                yield pb.GenerateResponse(token_ids=[i], index=i, text="x",
                                          usage=pb.Usage(prompt_tokens=5) if last else None)
        finally:
            self.in_flight -= 1


@pytest.fixture
async def echo_target():
    servicer = EchoInference()
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(None)


async def test_closed_loop_keeps_n_clients_busy(echo_target):
    target, servicer = echo_target
    specs = build_workload(make_config(requests=24, output_tokens=parse_dist("4"), api_keys=["good", "bad"],
                                       tenant_weights=[3.0, 1.0]))
    seen = []
    results, wall = await run_closed(specs, 4, RunSettings(target=target), seen.append)
    assert [r.tenant for r in results] == [s.tenant for s in specs]
    assert len(seen) == 24 and wall > 0
    assert servicer.max_in_flight == 4
    for spec, r in zip(specs, results):
        assert r.code == ("OK" if spec.api_key == "good" else "UNAUTHENTICATED")
        assert r.output_tokens == (4 if r.ok else 0)
        assert r.prompt_tokens == (5 if r.ok else 0)
        assert r.ok == (r.ttft_s is not None)


async def test_open_loop_sends_every_request_at_its_time(echo_target):
    target, servicer = echo_target
    specs = build_workload(make_config(requests=10, output_tokens=parse_dist("2"), api_keys=["good"]))
    arrivals = [0.02 * i for i in range(10)]
    results, wall = await run_open(specs, arrivals, RunSettings(target=target))
    assert servicer.calls == 10 and all(r.ok for r in results)
    starts = [r.start_s for r in results]
    assert starts == sorted(starts)
    assert wall >= arrivals[-1]
    with pytest.raises(ValueError):
        await run_open(specs, arrivals[:3], RunSettings(target=target))


async def test_unreachable_target_counts_unavailable():
    specs = build_workload(make_config(requests=3, api_keys=["good"]))
    results, _ = await run_closed(specs, 2, RunSettings(target="127.0.0.1:1", timeout_s=5))
    assert [r.code for r in results] == ["UNAVAILABLE"] * 3


def _result(tenant: int, ttft: float, end: float, tokens: int, prompt: int, code: str = "OK") -> RequestResult:
    chunks = [ttft + (end - ttft) * i / max(1, tokens - 1) for i in range(tokens)]
    return RequestResult(tenant=tenant, code=code, start_s=0.0, end_s=end, first_token_s=ttft,
                         chunk_times_s=chunks, chunk_tokens=[1] * tokens, prompt_tokens=prompt)


def test_goodput_counts_requests_within_every_target_and_jain_over_tenant_tokens():
    results = [_result(0, 0.1, 1.0, 10, 90),             # ttft 100 ms, tpot 100 ms: met
               _result(0, 0.6, 1.0, 5, 95),              # ttft 600 ms: missed
               _result(1, 0.1, 3.7, 10, 0),              # tpot 400 ms: missed
               _result(1, 0.1, 0.2, 2, 0, code="UNAVAILABLE")]
    summary = summarize_goodput(results, Targets(ttft_ms=500, tpot_ms=200), wall_s=2.0)
    assert summary["met"] == 1 and summary["goodput_per_s"] == 0.5
    assert summary["by_tenant"]["0"]["tokens_per_s"] == 100.0 and summary["by_tenant"]["1"]["tokens_per_s"] == 5.0
    assert summary["jain_tokens"] == jain([100.0, 5.0])
    assert jain([3.0, 3.0]) == 1.0 and jain([1.0, 0.0]) == 0.5 and jain([]) is None
    assert summarize_goodput(results, Targets(), wall_s=2.0)["met"] == 3   # no targets: every OK request


def test_requests_carry_the_slo_targets_only_when_set():
    spec = build_workload(WorkloadConfig(requests=1, prompt_tokens=parse_dist("8"), output_tokens=parse_dist("4"),
                                         api_keys=["k"], seed=0))[0]
    targeted = build_request(spec, RunSettings(target="x", slo=Targets(300, 40)))
    assert (targeted.slo_ttft_ms, targeted.slo_tpot_ms) == (300, 40)
    assert not build_request(spec, RunSettings(target="x")).HasField("slo_ttft_ms")
