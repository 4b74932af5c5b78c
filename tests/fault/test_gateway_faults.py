"""Gateway faults under ≥16 concurrent streams: SIGTERM drains open streams; after kill -9 the
clients resume (x-resume-from) through another gateway with nothing lost or repeated."""

from __future__ import annotations

import signal
import time

import pytest

from llmserve.loadgen.streams import PROMPTS, StreamLoad, mismatches, stall_s

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STREAMS = 16
MAX_NEW_TOKENS = 24
GRACE_S = 30.0


def test_sigterm_gateway_finishes_open_streams(start_stack):
    stack = start_stack(workers=1, gateways=1, extra_flags={"gateway": ["--grace-s", str(GRACE_S)]})
    gateway = stack.named("gateway-")[0]
    load = StreamLoad(gateway.target, "dev-key", PROMPTS[:STREAMS], max_new_tokens=MAX_NEW_TOKENS,
                      retry=None)
    baseline = load.run("base")
    running = load.start("sigterm")
    running.wait_started(STREAMS // 2)
    gateway.signal(signal.SIGTERM)
    records = running.join()
    assert mismatches(records, baseline) == []
    assert gateway.wait(GRACE_S + 30) == 0, gateway.log_tail()


def test_kill9_gateway_clients_resume_through_another(start_stack):
    stack = start_stack(workers=1, gateways=2)
    first, second = stack.named("gateway-")
    # pick_first over both addresses: the channel moves to the second gateway when the first dies.
    target = f"ipv4:{first.target},{second.target}"
    load = StreamLoad(target, "dev-key", PROMPTS[:STREAMS], max_new_tokens=MAX_NEW_TOKENS)
    baseline = load.run("base")
    running = load.start("kill9")
    running.wait_started(STREAMS // 2)
    stack.kill(first.name)
    fault_at = time.monotonic()
    records = running.join()
    interrupted = [r for r in records if r.largest_gap_after(fault_at) is not None and r.chunk_times_s
                   and r.chunk_times_s[0] < fault_at]
    print(f"\nkill -9 {first.name}: {len(interrupted)} streams resumed via {second.name}, "
          f"longest client stall {stall_s(records, fault_at)} s")
    assert mismatches(records, baseline) == []
    assert interrupted, "no stream was open on the killed gateway"
