"""The batcher counts every choice of an n > 1 item: token-fair share and KV blocks at dispatch."""

from __future__ import annotations

from batcher.fair_queue import Held
from batcher.workers import blocks_needed
from llmserve.v1 import queue_pb2


def make_item(n: int = 0, handed_back: int = 0) -> queue_pb2.WorkItem:
    item = queue_pb2.WorkItem(prompt_token_ids=list(range(32)), n=n,
                              sampling=queue_pb2.ResolvedSampling(max_new_tokens=64))
    item.choices.extend(queue_pb2.ChoiceProgress(index=i, generated_token_ids=[1]) for i in range(handed_back))
    return item


def held(item: queue_pb2.WorkItem) -> Held:
    return Held("s", "1-0", item, 0.0)


def test_fair_share_charges_every_choice():
    assert held(make_item(n=3)).virtual_tokens == 3 * held(make_item()).virtual_tokens == 3 * 96


def test_a_handed_back_item_counts_the_choices_it_still_runs():
    assert held(make_item(n=4, handed_back=2)).virtual_tokens == 2 * (32 + 64)


def test_choices_share_the_prompt_blocks_and_decode_apart():
    assert blocks_needed(make_item(), 16, 1.0) == 6
    assert blocks_needed(make_item(n=3), 16, 1.0) == (32 + 3 * 64) // 16
