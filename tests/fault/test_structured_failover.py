"""Structured output that survives moving: seeded, schema-constrained streams give exactly the
fault-free run's tokens, and valid documents, through a SIGTERM drain that hands running
sequences back mid-document (drain timeout 0: the next worker rebuilds the matcher from
WorkItem.generated_token_ids) and through kill -9 of one of two workers (reclaimed, re-run).

One stack for the module: the drain test replaces the drained worker, the kill test then
kills one of the two.
"""

from __future__ import annotations

import json
import signal
import time

import jsonschema
import pytest

from llmserve.loadgen.streams import PROMPTS, StreamLoad, mismatches
from llmserve.local.stack import Stack, StackConfig
from llmserve.v1 import inference_pb2 as pb
from tests.conftest import TEST_TENANTS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STREAMS = 6
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 16},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    "tags": {"type": "array", "items": {"enum": ["fact", "guess", "joke"]}, "minItems": 1, "maxItems": 2}},
    "required": ["answer", "confidence", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = StackConfig(workers=2, device="cpu", port=0, http_port=0, tenants=TEST_TENANTS,
                         log_dir=tmp_path_factory.mktemp("structured-failover"),
                         extra_flags={"gpu_worker": ["--drain-timeout-s", "0"]})
    running = Stack(config).start()
    yield running
    running.close()


@pytest.fixture(scope="module")
def load(stack):
    return StreamLoad(stack.gateway_target, "dev-key", PROMPTS[:STREAMS], max_new_tokens=64, temperature=0.9,
                      response_format=pb.ResponseFormat(json_schema=json.dumps(SCHEMA)))


@pytest.fixture(scope="module")
def baseline(load):
    records = load.run("structured-base")
    for r in records:
        assert r.error is None and r.finish_reason == "stop", (r.request_id, r.error, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMA)
    return records


def busiest_worker(stack: Stack, inbox_pending) -> str:
    pending = inbox_pending(stack)
    victim = max(pending, key=pending.get)
    assert pending[victim] > 0, pending
    return victim


def test_sigterm_drain_hands_back_mid_document(stack, load, baseline, inbox_pending):
    running = load.start("structured-drain")
    running.wait_started(STREAMS // 2)
    victim = busiest_worker(stack, inbox_pending)
    worker = stack.services[victim]
    worker.signal(signal.SIGTERM)
    replacement = stack.start_worker()
    records = running.join()
    assert mismatches(records, baseline) == []
    assert worker.wait(120) == 0, worker.log_tail()
    handed = [json.loads(line) for line in worker.log_path.read_text().splitlines() if '"handed back"' in line]
    assert handed and handed[-1]["items"] > 0, handed   # sequences moved mid-document, not finished in place
    replacement.wait_serving(time.monotonic() + 300)


def test_kill9_of_one_of_two_workers(stack, load, baseline, inbox_pending):
    running = load.start("structured-kill9")
    running.wait_started(STREAMS // 2)
    stack.kill(busiest_worker(stack, inbox_pending))
    records = running.join()
    assert mismatches(records, baseline) == []
