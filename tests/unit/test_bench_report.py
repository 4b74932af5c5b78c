"""bench/openai_standard.py's result file and bench/report.py's tables rendered from it."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime

import pytest

from bench import openai_standard, report

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse4_2 avx fma f16c avx2 avx512f avx512_vnni avx512_bf16 amx_tile sha_ni
processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse4_2 avx fma f16c avx2 avx512f avx512_vnni avx512_bf16 amx_tile sha_ni
"""


def guidellm_benchmark(ttft: tuple[float, float, float], itl: tuple[float, float, float], tokens: list[int],
                       duration: float) -> dict:
    """The parts of one of guidellm's benchmarks that summarize() reads."""
    def metric(p50: float, p95: float, p99: float) -> dict:
        return {"successful": {"mean": p50, "percentiles": {"p50": p50, "p95": p95, "p99": p99}}}

    return {"duration": duration,
            "metrics": {"time_to_first_token_ms": metric(*ttft), "inter_token_latency_ms": metric(*itl),
                        "time_per_output_token_ms": {"successful": {"mean": 20.0}}},
            "requests": {"successful": [{"time_to_first_token_ms": 900.0 + 200 * i, "time_per_output_token_ms": 20.0,
                                         "output_tokens": n} for i, n in enumerate(tokens)],
                         "errored": []}}


def level(streams: int, tok_s: float, ttft: tuple[float, float], itl: tuple[float, float]) -> dict:
    benchmark = guidellm_benchmark((*ttft, ttft[1] + 1), (*itl, itl[1] + 1), [64] * 4, 4 * 64 / tok_s)
    return openai_standard.summarize(benchmark, streams, slo_ttft_ms=1000.0, slo_tpot_ms=100.0)


def record(**overrides) -> dict:
    args = openai_standard.parse_args(["--llama-server", "/opt/llama/build/bin/llama-server", "--order", "both",
                                       "--concurrency", "1,4"])
    passes = [{"order": ["llama-server", "llmserve"],
               "servers": {"llama-server": [level(1, 50.0, (500, 600), (10, 12)), level(4, 100.0, (700, 900), (20, 25))],
                           "llmserve": [level(1, 55.0, (350, 400), (11, 13)), level(4, 150.0, (650, 800), (18, 22))]}},
              {"order": ["llmserve", "llama-server"],
               "servers": {"llmserve": [level(1, 54.0, (340, 390), (11, 12)), level(4, 160.0, (640, 780), (17, 21))],
                           "llama-server": [level(1, 48.0, (510, 620), (10, 12)), level(4, 80.0, (710, 950), (21, 26))]}}]
    llama = {"binary": args.llama_server, "version": "version: 7000 (abc1234)\nbuilt with cc for x86_64",
             "build_options": "GGML_NATIVE=ON", "command": "llama-server -m m.gguf", "system_info": "AVX2 = 1"}
    machine = {**openai_standard.parse_cpuinfo(CPUINFO), "usable_cpus": 2}
    model = {"file": "smollm2.gguf", "sha256_prefix": "0123456789abcdef"}
    built = openai_standard.run_record(args, ["bench/openai_standard.py", "--order", "both"], machine, model, llama,
                                       passes, datetime(2026, 12, 3, 8, 0, 5, tzinfo=UTC))
    return {**built, **overrides}


def test_cpuinfo_keeps_the_kernel_flags_only():
    assert openai_standard.parse_cpuinfo(CPUINFO) == {
        "cpu_model": "AMD EPYC 9R14 96-Core Processor", "logical_cpus": 2,
        "cpu_flags": ["amx_tile", "avx2", "avx512_bf16", "avx512_vnni", "avx512f", "f16c", "fma"]}


def test_this_machine_is_named():
    machine = openai_standard.machine_info()
    assert machine["cpu_model"] != "unknown"
    assert 1 <= machine["usable_cpus"] <= machine["logical_cpus"]
    assert all(openai_standard.KERNEL_FLAGS.match(flag) for flag in machine["cpu_flags"])


def test_summarize_reads_percentiles_throughput_and_goodput():
    benchmark = guidellm_benchmark((800.0, 1200.0, 1300.0), (15.0, 19.0, 22.0), [64, 64, 32], duration=4.0)
    row = openai_standard.summarize(benchmark, 2, slo_ttft_ms=1000.0, slo_tpot_ms=100.0)
    assert row == {"concurrency": 2, "requests": 3, "errors": 0, "output_tok_s": 40.0, "requests_s": 0.75,
                   "ttft_ms_p50": 800.0, "ttft_ms_p95": 1200.0, "ttft_ms_p99": 1300.0,
                   "itl_ms_p50": 15.0, "itl_ms_p95": 19.0, "itl_ms_p99": 22.0, "tpot_ms_mean": 20.0,
                   "goodput_share": 1 / 3, "goodput_requests_s": 0.25}   # TTFT 900 passes, 1100 and 1300 do not


def test_the_model_is_named_by_its_sha256(smollm2_path):
    identity = openai_standard.model_identity(smollm2_path)
    assert identity == {"file": smollm2_path.name,
                        "sha256_prefix": hashlib.sha256(smollm2_path.read_bytes()).hexdigest()[:16]}


def test_build_options_come_from_the_cmake_cache(tmp_path):
    (tmp_path / "build" / "bin").mkdir(parents=True)
    (tmp_path / "build" / "bin" / "llama-server").touch()
    (tmp_path / "build" / "CMakeCache.txt").write_text(
        "// comment\nGGML_NATIVE:BOOL=OFF\nGGML_AVX2:BOOL=ON\nGGML_CUDA:BOOL=OFF\nLLAMA_CURL:BOOL=OFF\n"
        "CMAKE_BUILD_TYPE:STRING=Release\nCMAKE_CXX_FLAGS:STRING=\n")
    assert openai_standard.cmake_options(tmp_path / "build" / "bin" / "llama-server") == \
        "GGML_NATIVE=OFF GGML_AVX2=ON CMAKE_BUILD_TYPE=Release"
    assert openai_standard.cmake_options(tmp_path / "llama-server") == ""


def test_a_run_is_written_as_one_json_file(tmp_path):
    written = openai_standard.write_result(record(), tmp_path)
    assert written.name == "20261203T080005Z-chat-p128.json"
    back = json.loads(written.read_text())
    assert back == record()
    assert back["date"] == "2026-12-03T08:00:05Z"
    assert back["workload"]["request_format"] == "/v1/chat/completions"
    assert [p["order"] for p in back["passes"]] == [["llama-server", "llmserve"], ["llmserve", "llama-server"]]


def test_distinct_prompts_go_to_text_completions():
    args = openai_standard.parse_args(["--distinct-prompts", "--prompt-tokens", "1500"])
    built = openai_standard.run_record(args, [], {}, {}, None, [], datetime(2026, 12, 3, tzinfo=UTC))
    assert built["workload"]["prompts"] == "distinct"
    assert built["workload"]["request_format"] == "/v1/completions"
    assert built["workload"]["prompt_tokens"] == 1500


def test_a_missing_tool_stops_the_run_before_any_server_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(openai_standard, "measure", lambda *a, **k: pytest.fail("a server was measured"))
    with pytest.raises(SystemExit, match="guidellm not found"):
        openai_standard.main(["--guidellm", str(tmp_path / "no-guidellm")])
    guidellm = tmp_path / "guidellm"
    guidellm.write_text("#!/bin/sh\n")
    guidellm.chmod(0o755)
    with pytest.raises(SystemExit, match="is not an executable file"):
        openai_standard.main(["--guidellm", str(guidellm), "--llama-server", str(tmp_path / "no-llama-server")])
    assert openai_standard.missing_tool(openai_standard.parse_args(["--guidellm", str(guidellm)])) == ""


def test_a_run_renders_one_row_a_pass_and_level():
    text = report.render_run("20261203T080005Z-chat-p128.json", record())
    lines = text.splitlines()
    assert lines[0] == ("### 2026-12-03 08:00:05 UTC: AMD EPYC 9R14 96-Core Processor, "
                        "128-token chat prompts, 64 output tokens")
    assert "`bench/results/openai_standard/20261203T080005Z-chat-p128.json`" in text
    assert "build: GGML_NATIVE=ON" in text and "version: 7000 (abc1234);" in text
    table = lines[lines.index(next(line for line in lines if line.startswith("| pass"))):]
    assert table == [
        "| pass (order) | streams | llama-server tok/s | llmserve tok/s | ratio | llama-server TTFT p50 / p95 ms"
        " | llmserve TTFT p50 / p95 ms | llama-server ITL p50 / p95 ms | llmserve ITL p50 / p95 ms |",
        "|---|---|---|---|---|---|---|---|---|",
        "| 1 (llama-server first) | 1 | 50.0 | 55.0 | 1.10 | 500 / 600 | 350 / 400 | 10 / 12 | 11 / 13 |",
        "| 1 (llama-server first) | 4 | 100.0 | 150.0 | 1.50 | 700 / 900 | 650 / 800 | 20 / 25 | 18 / 22 |",
        "| 2 (llmserve first) | 1 | 48.0 | 54.0 | 1.12 | 510 / 620 | 340 / 390 | 10 / 12 | 11 / 12 |",
        "| 2 (llmserve first) | 4 | 80.0 | 160.0 | 2.00 | 710 / 950 | 640 / 780 | 21 / 26 | 17 / 21 |",
    ]


def test_a_run_without_llama_server_has_no_ratio():
    alone = record(llama_server=None, passes=[{"order": ["llmserve"],
                                               "servers": {"llmserve": [level(1, 55.0, (350, 400), (11, 13))]}}])
    text = report.render_run("x.json", alone)
    assert "ratio" not in text and "llama-server" not in text
    assert text.splitlines()[-1] == "| 1 (llmserve) | 1 | 55.0 | 350 / 400 | 11 / 13 |"


def test_the_region_between_the_markers_is_rewritten_and_nothing_else():
    doc = f"# Title\nhand text\n{report.BEGIN}\nold table\n{report.END}\nmore hand text\n"
    assert report.replace_region(doc, "new") == f"# Title\nhand text\n{report.BEGIN}\nnew\n{report.END}\nmore hand text\n"
    with pytest.raises(ValueError):
        report.replace_region("# no markers\n", "new")


def test_check_fails_on_a_stale_doc_and_passes_once_rendered(tmp_path):
    runs = tmp_path / "runs"
    openai_standard.write_result(record(), runs)
    doc = tmp_path / "performance.md"
    doc.write_text(f"intro\n{report.BEGIN}\n{report.EMPTY}\n{report.END}\n")
    assert report.main(["--results", str(runs), "--doc", str(doc), "--check"]) == 1
    assert report.main(["--results", str(runs), "--doc", str(doc)]) == 0
    assert report.main(["--results", str(runs), "--doc", str(doc), "--check"]) == 0
    assert "| 2 (llmserve first) | 4 | 80.0 | 160.0 | 2.00 |" in doc.read_text()


def test_docs_performance_is_rendered_from_the_committed_results():
    assert report.main(["--check"]) == 0, "docs/performance.md's generated region is stale: run bench/report.py"


def test_every_guidellm_run_of_a_bench_draws_its_own_prompts():
    """guidellm draws the same prompts for the same seed: a level that reused the warm-up's seed was
    served from both servers' prefix caches (a 1,500-token "distinct" prompt's TTFT was ~200 ms)."""
    levels = 4
    runs = [(pass_number, run) for pass_number in (1, 2) for run in range(levels + 1)]  # run 0: the warm-up
    seeds = [openai_standard.prompt_seed(pass_number, run) for pass_number, run in runs]
    assert len(set(seeds)) == len(runs)


def test_a_temperature_goes_to_every_request_and_into_the_heading():
    args = openai_standard.parse_args(["--temperature", "0"])
    assert openai_standard.sampling_extras(args) == ",extras.body.temperature=0.0"
    assert openai_standard.sampling_extras(openai_standard.parse_args([])) == ""
    built = openai_standard.run_record(args, [], {}, {}, None, [], datetime(2026, 12, 6, tzinfo=UTC))
    assert built["workload"]["temperature"] == 0.0
    greedy = record()
    greedy["workload"]["temperature"] = 0.0
    assert report.render_run("x.json", greedy).splitlines()[0].endswith("64 output tokens, greedy")
    greedy["workload"]["temperature"] = 0.7
    assert report.render_run("x.json", greedy).splitlines()[0].endswith("64 output tokens, temperature 0.7")
