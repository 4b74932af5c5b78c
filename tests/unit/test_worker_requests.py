"""Work item <-> sequence: the prefix-cache salt survives admission and drain handoff."""

from __future__ import annotations

from gpu_worker.requests import Tracked
from llmserve.v1 import queue_pb2


def make_item(salt: str) -> queue_pb2.WorkItem:
    return queue_pb2.WorkItem(request_id="r1", tenant="acme", prompt_token_ids=list(range(40)),
                              sampling=queue_pb2.ResolvedSampling(max_new_tokens=8), cache_salt=salt)


def test_sequence_takes_the_items_cache_salt():
    assert Tracked.from_item(make_item("group:team"), "1-0").seq.cache_salt == "group:team"


def test_handed_back_item_keeps_its_salt_next_to_the_tokens_produced():
    tracked = Tracked.from_item(make_item("tenant:acme"), "1-0")
    tracked.seq.append_token(7)
    item = tracked.handoff_item()
    assert (item.cache_salt, list(item.generated_token_ids)) == ("tenant:acme", [7])
    again = Tracked.from_item(queue_pb2.WorkItem.FromString(item.SerializeToString()), "2-0")
    assert again.seq.cache_salt == "tenant:acme" and again.seq.token_ids[-1] == 7


def test_each_choice_also_stops_on_its_own_cancel_key():
    item = make_item("")
    item.cancel_key = "llmserve:{r:t:x}:cancel"
    assert [t.cancel_keys for t in Tracked.choices_of(item, "1-0")] == [("llmserve:{r:t:x}:cancel",)]
    item.n = 2
    assert [t.cancel_keys[1] for t in Tracked.choices_of(item, "1-0")] == \
        ["llmserve:{r:t:x}:cancel:0", "llmserve:{r:t:x}:cancel:1"]
