"""Prompt-lookup speculation on the real stack with its defaults (a CPU worker drafts 3 tokens while one
sequence runs): a greedy request that quotes its prompt has drafts kept (the worker's counters), and its
multi-token steps stream as the same text the unstreamed answer gives. That the tokens equal plain
decoding's is the engine's to show (tests/integration/test_engine_speculation.py)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

QUOTE = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the warm sun all day long."
MESSAGES = [{"role": "user", "content": f"Repeat this sentence exactly, twice: {QUOTE}"}]


def draft_counters(stack) -> dict[str, float]:
    port = stack.services["gpu_worker-0"].metrics_port_path.read_text().strip()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = {"llmserve_worker_draft_tokens", "llmserve_worker_accepted_draft_tokens"}
    return {family.name: family.samples[0].value for family in text_string_to_metric_families(text)
            if family.name in wanted}


def test_a_quoting_greedy_answer_keeps_drafts_and_streams_the_same_text(stack, client):
    before = draft_counters(stack)
    whole = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, temperature=0, max_tokens=48)
    after = draft_counters(stack)
    drafted = after["llmserve_worker_draft_tokens"] - before["llmserve_worker_draft_tokens"]
    kept = after["llmserve_worker_accepted_draft_tokens"] - before["llmserve_worker_accepted_draft_tokens"]
    assert 0 < kept <= drafted
    chunks = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, temperature=0, max_tokens=48,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
