"""Soak: steady load must not grow RSS, open fds, Redis memory or keys (every per-request key expires).

60 s in the normal run; LLMSERVE_SOAK=1 makes it the 10-minute soak.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from llmserve.loadgen.soak import SoakConfig, soak
from llmserve.local.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

LONG = os.environ.get("LLMSERVE_SOAK") == "1"
TENANTS = Path(__file__).resolve().parents[1] / "data" / "tenants.test.yaml"
TTL = ["--events-ttl-s", "10"]   # per-request keys expire within the run


@pytest.fixture(scope="module")
def soak_stack(tmp_path_factory):
    config = StackConfig(workers=1, device="cpu", port=0, tenants=TENANTS, log_dir=tmp_path_factory.mktemp("soak"),
                         extra_flags={"gateway": TTL, "batcher": TTL, "gpu_worker": TTL})
    stack = Stack(config).start()
    yield stack
    stack.close()


def test_soak_nothing_grows(soak_stack):
    config = SoakConfig(duration_s=600.0 if LONG else 60.0, concurrency=4, sample_every_s=10.0 if LONG else 5.0)
    report = asyncio.run(soak(soak_stack, config))
    first, last = report.samples[0], report.samples[-1]
    print(f"\nsoak {config.duration_s:.0f} s: {report.summary['ok']}/{report.summary['requests']} ok; "
          f"RSS MB {({n: round(v / 2**20) for n, v in first.rss_bytes.items()})} -> "
          f"{({n: round(v / 2**20) for n, v in last.rss_bytes.items()})}; fds {first.fds} -> {last.fds}; "
          f"request keys peak {max(s.request_keys for s in report.samples)}, after expiry "
          f"{report.after_expiry.request_keys}; Redis used_memory MB {report.before.redis_used_memory / 2**20:.1f} "
          f"-> {report.after_expiry.redis_used_memory / 2**20:.1f}")
    assert report.summary["requests"] >= config.concurrency
    assert report.problems() == []
    assert max(s.request_keys for s in report.samples) > 0   # the expiry check had keys to watch
    assert all(s.alive() for s in soak_stack.services.values())
