"""Worker faults under ≥16 concurrent streams: kill -9 mid-generation, and a rolling upgrade.

Every request must complete with exactly the fault-free run's tokens and contiguous indices
(the client SDK may retry and resume; nothing may be lost or duplicated).
"""

from __future__ import annotations

import signal
import time

import pytest

from llmserve.loadgen.streams import PROMPTS, StreamLoad, mismatches, stall_s

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STREAMS = 16
MAX_NEW_TOKENS = 24


def test_kill9_one_of_two_workers_mid_generation(start_stack, inbox_pending):
    stack = start_stack(workers=2)
    load = StreamLoad(stack.gateway_target, "dev-key", PROMPTS[:STREAMS], max_new_tokens=MAX_NEW_TOKENS)
    baseline = load.run("base")
    assert mismatches(baseline, baseline) == []
    running = load.start("kill9")
    running.wait_started(STREAMS // 2)
    pending = inbox_pending(stack)
    victim = max(pending, key=pending.get)
    assert pending[victim] > 0, pending    # the victim holds running sequences
    stack.kill(victim)
    fault_at = time.monotonic()
    records = running.join()
    print(f"\nkill -9 {victim} (pending {pending}): longest client stall {stall_s(records, fault_at):.2f} s")
    assert mismatches(records, baseline) == []
    survivor = next(w for w in stack.named("gpu_worker-") if w.name != victim)
    assert survivor.alive()


def test_rolling_upgrade_loses_nothing(start_stack):
    stack = start_stack(workers=2)
    load = StreamLoad(stack.gateway_target, "dev-key", PROMPTS[:STREAMS], max_new_tokens=MAX_NEW_TOKENS)
    baseline = load.run("base")
    for old in list(stack.named("gpu_worker-")):
        running = load.start(f"upgrade-{old.name}")
        running.wait_started(STREAMS // 2)
        old.signal(signal.SIGTERM)                     # drain: finish or hand back, then exit 0
        fault_at = time.monotonic()
        replacement = stack.start_worker()
        replacement.wait_serving(time.monotonic() + 300)
        records = running.join()
        print(f"\nupgrade of {old.name}: longest client stall {stall_s(records, fault_at):.2f} s")
        assert mismatches(records, baseline) == []
        assert old.wait(120) == 0, old.log_tail()
    assert sorted(w.name for w in stack.named("gpu_worker-") if w.alive()) == ["gpu_worker-2", "gpu_worker-3"]
