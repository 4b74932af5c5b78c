"""Token events carry one logprob entry per token, by completion index, and the choice they belong to."""

from __future__ import annotations

import pytest

from gpu_worker.engine.sequence import TokenLogprobs
from gpu_worker.events import Emission, build_event
from gpu_worker.requests import Tracked
from llmserve.v1 import queue_pb2


def make_item(logprobs: bool) -> queue_pb2.WorkItem:
    return queue_pb2.WorkItem(request_id="r", tenant="t", prompt_token_ids=[1, 2], generated_token_ids=[5, 6],
                              sampling=queue_pb2.ResolvedSampling(max_new_tokens=8, logprobs=logprobs,
                                                                  top_logprobs=1))


def test_entries_follow_the_tokens_after_a_handoff():
    tracked = Tracked.from_item(make_item(True), "1-0", choice=2)
    for token, logprob in ((7, -0.25), (8, -1.5)):
        tracked.seq.sampled = TokenLogprobs(logprob, ((token, logprob),))
        tracked.seq.append_token(token)
    event = build_event(Emission(tracked, (8,), index=3), "w")          # completion index 3: the second new one
    assert event.choice_index == 2
    assert [(e.token_id, e.logprob, [t.token_id for t in e.top]) for e in event.logprobs] == [(8, -1.5, [8])]
    both = build_event(Emission(tracked, (7, 8), index=2), "w")
    assert [e.logprob for e in both.logprobs] == pytest.approx([-0.25, -1.5])


def test_no_entries_when_the_request_did_not_ask():
    tracked = Tracked.from_item(make_item(False), "1-0")
    tracked.seq.append_token(7)
    assert not build_event(Emission(tracked, (7,), index=2), "w").logprobs
