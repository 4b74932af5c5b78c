"""Pure logic of tokenizer_svc: dispatch policy, LRU cache, segment encoder, request validation."""

from __future__ import annotations

import pytest

from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as ipb
from llmserve.v1 import tokenizer_pb2 as pb
from tokenizer_svc import protocol
from tokenizer_svc.cache import LRUCache
from tokenizer_svc.dispatch import Dispatcher, ProcessLoad
from tokenizer_svc.loader import load_tokenizer
from tokenizer_svc.segments import SegmentEncoder
from tokenizer_svc.validation import Limits, batch_size, decode_op, encode_op

I, B = protocol.LANE_INTERACTIVE, protocol.LANE_BULK  # noqa: E741 - short lane names keep the tables readable


def make_load(interactive: int = 0, bulk: int = 0, bulk_bytes: int = 0) -> ProcessLoad:
    load = ProcessLoad()
    for _ in range(interactive):
        load.add(I, 100)
    for _ in range(bulk):
        load.add(B, bulk_bytes // max(bulk, 1))
    return load


# ------------------------------------------------------------------------------------ dispatch

def test_short_task_avoids_the_process_busy_with_a_long_one():
    loads = [make_load(bulk=1, bulk_bytes=40_000), make_load()]
    assert Dispatcher().choose(loads, I) == 1


def test_short_task_prefers_fewer_interactive_tasks_over_idle_bulk_lane():
    loads = [make_load(interactive=2), make_load(interactive=1, bulk=1, bulk_bytes=40_000)]
    assert Dispatcher().choose(loads, I) == 1


def test_long_task_goes_to_the_least_bulk_bytes():
    loads = [make_load(bulk=1, bulk_bytes=90_000), make_load(bulk=2, bulk_bytes=30_000), make_load(interactive=3)]
    assert Dispatcher().choose(loads, B) == 2
    loads = [make_load(bulk=1, bulk_bytes=90_000), make_load(bulk=2, bulk_bytes=30_000)]
    assert Dispatcher().choose(loads, B) == 1


def test_ties_rotate_over_equal_processes():
    dispatcher = Dispatcher()
    loads = [make_load(), make_load(), make_load()]
    assert [dispatcher.choose(loads, I) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_load_accounting_add_remove():
    load = ProcessLoad()
    load.add(B, 5000)
    load.add(I, 10)
    assert (load.count, load.cost, load.total) == ([1, 1], [10, 5000], 2)
    load.remove(B, 5000)
    assert (load.count, load.cost) == ([1, 0], [10, 0])
    with pytest.raises(AssertionError):
        load.remove(B, 1)


# ------------------------------------------------------------------------------------ LRU cache

def test_lru_evicts_least_recently_used_under_byte_budget():
    cache: LRUCache[str] = LRUCache(max_bytes=80)
    assert cache.put("a", "A", 10) and cache.put("b", "B", 10)
    assert cache.get("a") == "A"           # a is now the most recent
    for key in "cdefgh":
        cache.put(key, key.upper(), 10)    # 80 bytes: a..h fit exactly
    cache.put("i", "I", 10)                # evicts b (least recent)
    assert cache.get("b") is None
    assert cache.get("a") == "A"
    assert (cache.hits, cache.misses, cache.bytes, len(cache)) == (2, 1, 80, 8)


def test_lru_refuses_entries_over_an_eighth_of_the_budget():
    cache: LRUCache[str] = LRUCache(max_bytes=80)
    assert not cache.put("big", "x", 11)
    assert cache.put("ok", "x", 10)
    assert cache.get("big") is None and cache.bytes == 10


def test_lru_refresh_replaces_size():
    cache: LRUCache[str] = LRUCache(max_bytes=800)
    cache.put("a", "1", 10)
    cache.put("a", "2", 30)
    assert (cache.get("a"), cache.bytes, len(cache)) == ("2", 30, 1)


# ------------------------------------------------------------------------------------ segments

@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_tokenizer(smollm2_path)


CONVERSATIONS = [
    [{"role": "system", "content": "You are terse. Rules: 1) be kind 2) cite sources. 你好 🎉"},
     {"role": "user", "content": "What is 12*12?"}],
    [{"role": "system", "content": "You are terse. Rules: 1) be kind 2) cite sources. 你好 🎉"},
     {"role": "user", "content": "What is 12*12?"}, {"role": "assistant", "content": "144.\n"},
     {"role": "user", "content": "  and 13*13?  "}],
    [{"role": "user", "content": "no system prompt: the template adds its default"}],
    [{"role": "user", "content": "user writes <|im_end|> and <|im_start|>system inside"}],
]


def test_segment_encoding_equals_whole_prompt_encoding(smollm2):
    encoder = SegmentEncoder(smollm2, max_bytes=1 << 20)
    assert encoder.enabled
    for messages in CONVERSATIONS * 2:  # second round: served from the cache
        prompt = smollm2.render_chat(messages)
        assert encoder.encode(prompt) == smollm2.encode(prompt)
    assert encoder.cache.hits > 0


def test_system_prompt_and_earlier_turns_hit_the_segment_cache(smollm2):
    encoder = SegmentEncoder(smollm2, max_bytes=1 << 20)
    encoder.encode(smollm2.render_chat(CONVERSATIONS[0]))
    misses_before = encoder.cache.misses
    encoder.encode(smollm2.render_chat(CONVERSATIONS[1]))
    # new segments: "assistant\n144.\n" and "user\n  and 13*13?  "; system, first user turn and "\n" hit
    assert encoder.cache.misses - misses_before == 2
    assert encoder.cache.hits >= 4


def test_segment_cache_off_when_budget_is_zero(smollm2):
    encoder = SegmentEncoder(smollm2, max_bytes=0)
    prompt = smollm2.render_chat(CONVERSATIONS[0])
    assert not encoder.enabled
    assert encoder.encode(prompt) == smollm2.encode(prompt)
    assert len(encoder.cache) == 0


def test_segment_cache_disabled_for_a_tokenizer_where_it_would_be_inexact(smollm2):
    import dataclasses

    class WholeTextDependent(type(smollm2)):
        """A tokenizer whose ids depend on the whole input (a trailing length marker)."""

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return super().encode(text, add_special_tokens) + [len(text) % 7]

    odd = WholeTextDependent(**{f.name: getattr(smollm2, f.name) for f in dataclasses.fields(smollm2) if f.init})
    encoder = SegmentEncoder(odd, max_bytes=1 << 20)
    assert not encoder.enabled
    prompt = odd.render_chat(CONVERSATIONS[0])
    assert encoder.encode(prompt) == odd.encode(prompt)


# ------------------------------------------------------------------------------------ validation

LIMITS = Limits(max_text_bytes=100, max_messages=3, max_batch=2, max_decode_ids=5)


def _field_of(call) -> str:
    with pytest.raises(InvalidArgument) as info:
        call()
    return info.value.field


def test_text_op_and_limits():
    op = encode_op(pb.EncodeRequest(text="héllo", add_special_tokens=True), LIMITS)
    assert (op.name, op.args, op.cost) == (protocol.OP_ENCODE, ("héllo", True, False), 6)
    assert _field_of(lambda: encode_op(pb.EncodeRequest(text="x" * 101), LIMITS)) == "text"
    assert _field_of(lambda: encode_op(pb.EncodeRequest(text="é" * 51), LIMITS, "requests[1].")) == \
        "requests[1].text"


def test_chat_op_and_limits():
    messages = [ipb.ChatMessage(role="user", content="hi")]
    op = encode_op(pb.EncodeRequest(messages=messages), LIMITS)
    assert (op.name, op.args, op.cost) == (protocol.OP_CHAT, ((("user", "hi"),), True), 6)
    op = encode_op(pb.EncodeRequest(messages=messages, add_generation_prompt=False), LIMITS)
    assert op.args == ((("user", "hi"),), False)
    too_many = [ipb.ChatMessage(role="user", content="x")] * 4
    assert _field_of(lambda: encode_op(pb.EncodeRequest(messages=too_many), LIMITS)) == "messages"
    too_big = [ipb.ChatMessage(role="user", content="x" * 97)]
    assert _field_of(lambda: encode_op(pb.EncodeRequest(messages=too_big), LIMITS)) == "messages"
    no_role = [ipb.ChatMessage(role="user", content="a"), ipb.ChatMessage(role="", content="b")]
    assert _field_of(lambda: encode_op(pb.EncodeRequest(messages=no_role), LIMITS)) == "messages[1].role"
    both = pb.EncodeRequest(text="a", messages=messages)
    assert _field_of(lambda: encode_op(both, LIMITS)) == "text"


def test_batch_and_decode_limits():
    assert batch_size(pb.EncodeBatchRequest(requests=[pb.EncodeRequest()] * 2), LIMITS) == 2
    assert _field_of(lambda: batch_size(pb.EncodeBatchRequest(requests=[pb.EncodeRequest()] * 3), LIMITS)) == \
        "requests"
    op = decode_op(pb.DecodeRequest(token_ids=[1, 2, 3], skip_special_tokens=True), LIMITS, vocab_size=10)
    assert (op.name, list(op.args[0]), op.args[1], op.cost) == (protocol.OP_DECODE, [1, 2, 3], True, 12)
    assert _field_of(lambda: decode_op(pb.DecodeRequest(token_ids=[1] * 6), LIMITS, 10)) == "token_ids"
    assert _field_of(lambda: decode_op(pb.DecodeRequest(token_ids=[10]), LIMITS, 10)) == "token_ids"
