"""The load generator against the real stack: a tiny closed-loop sweep and an open-loop run."""

from __future__ import annotations

import json

import pytest

from llmserve.cli import main as cli_main
from llmserve.loadgen import main

pytestmark = pytest.mark.e2e


def test_closed_loop_sweep_writes_json_and_plot(stack, tmp_path):
    out = tmp_path / "bench.json"
    code = main(["--target", stack.gateway_target, "--api-key", "dev-key", "--concurrency", "1,2",
                 "--requests", "4", "--warmup", "0", "--prompt-tokens", "uniform:4:12", "--output-tokens", "8",
                 "--temperature", "0", "--no-progress", "--output", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "closed" and [lvl["load"] for lvl in report["levels"]] == [1, 2]
    for level in report["levels"]:
        s = level["summary"]
        assert s["requests"] == 4 and s["codes"] == {"OK": 4}
        assert 4 <= s["throughput"]["output_tokens"] <= 32
        assert s["ttft_s"]["count"] == 4
        assert 0 < s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]
        assert s["throughput"]["prompt_tokens"] >= 4 * 4
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_open_loop_through_the_cli_counts_bad_keys(stack, tmp_path, capsys):
    out = tmp_path / "open.json"
    code = cli_main(["bench", "--target", stack.gateway_target, "--api-key", "dev-key", "--api-key", "bad-key",
                     "--rate", "4", "--requests", "6", "--warmup", "0", "--output-tokens", "4", "--seed", "2",
                     "--no-progress", "--output", str(out)])
    assert code == 0
    level = json.loads(out.read_text())["levels"][0]
    by_tenant = level["summary"]["by_tenant"]
    assert set(by_tenant.get("0", {})) <= {"OK"} and set(by_tenant.get("1", {})) <= {"UNAUTHENTICATED"}
    assert sum(sum(c.values()) for c in by_tenant.values()) == 6
    assert "rate=4.0" in capsys.readouterr().out
