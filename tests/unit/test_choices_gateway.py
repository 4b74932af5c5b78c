"""n choices at the gateway: bounds, reservation, one builder per choice, the collected reply."""

from __future__ import annotations

import asyncio

import pytest

from gateway import choices
from gateway.validation import RequestLimits, validate_request
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2
from tokenizer_svc.loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path).tokenizer


def test_n_above_the_maximum_is_invalid_naming_n():
    with pytest.raises(InvalidArgument) as err:
        validate_request(pb.GenerateRequest(prompt="x", n=choices.MAX_CHOICES + 1), RequestLimits())
    assert err.value.field == "n"
    validate_request(pb.GenerateRequest(prompt="x", n=choices.MAX_CHOICES), RequestLimits())


def test_every_choice_reserves_its_prompt_and_max_new_tokens():
    assert choices.reserved_tokens(10, 20, 3) == 90
    assert choices.count(pb.GenerateRequest()) == 1


def test_builder_names_choices_counts_all_tokens_and_is_done_with_the_last(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False).ids
    builder = choices.ChoicesBuilder("r", tokenizer, [], 2)
    a = builder.feed(queue_pb2.TokenEvent(dispatch_epoch=1, choice_index=1, index=0, token_ids=ids[:2]))
    b = builder.feed(queue_pb2.TokenEvent(dispatch_epoch=1, choice_index=0, index=0, token_ids=ids, final=True,
                                          finish_reason=pb.FINISH_REASON_LENGTH))
    assert (a.choice_index, a.index, b.choice_index) == (1, 0, 0)
    assert not builder.done and builder.next_index == 2 + len(ids)
    c = builder.feed(queue_pb2.TokenEvent(dispatch_epoch=1, choice_index=1, index=2, token_ids=ids[2:], final=True,
                                          finish_reason=pb.FINISH_REASON_STOP))
    assert builder.done and c.index == 2 and builder.next_index == 2 * len(ids)
    assert builder.feed(queue_pb2.TokenEvent(dispatch_epoch=1, choice_index=5, index=0, token_ids=ids)) is None


def test_collect_puts_every_choice_in_choices_and_choice_0_on_top():
    async def chunks():
        yield pb.GenerateResponse(choice_index=1, text="b", token_ids=[2], index=0)
        yield pb.GenerateResponse(choice_index=0, text="a", token_ids=[1], index=0,
                                  finish_reason=pb.FINISH_REASON_STOP)
        yield pb.GenerateResponse(choice_index=1, text="c", token_ids=[3], index=1,
                                  finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=3))
    reply = asyncio.run(choices.collect("r", chunks()))
    assert [(c.choice_index, c.text, list(c.token_ids)) for c in reply.choices] == [(0, "a", [1]), (1, "bc", [2, 3])]
    assert (reply.text, reply.finish_reason, reply.usage.completion_tokens) == ("a", pb.FINISH_REASON_STOP, 3)
    assert reply.choices[1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_final_event_the_batcher_wrote_ends_every_choice(tokenizer):
    builder = choices.ChoicesBuilder("r", tokenizer, [], 3)
    chunk = builder.feed(queue_pb2.TokenEvent(index=0, final=True, finish_reason=pb.FINISH_REASON_CANCELLED))
    assert chunk.finish_reason == pb.FINISH_REASON_CANCELLED and builder.done


def test_a_choice_ended_by_a_stop_string_while_others_run_is_told_to_the_worker(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False).ids
    builder = choices.ChoicesBuilder("r", tokenizer, [" two"], 2)
    running = queue_pb2.TokenEvent(dispatch_epoch=1, choice_index=1, index=0, token_ids=ids[:1])
    assert not builder.ended_alone(builder.feed(running), running)
    stopping = queue_pb2.TokenEvent(dispatch_epoch=1, choice_index=0, index=0, token_ids=ids)
    chunk = builder.feed(stopping)
    assert chunk.finish_reason == pb.FINISH_REASON_STOP and builder.ended_alone(chunk, stopping)
    last = queue_pb2.TokenEvent(dispatch_epoch=1, choice_index=1, index=1, token_ids=ids[1:])
    chunk = builder.feed(last)                 # the last choice to stop ends the request: no choice key
    assert builder.done and not builder.ended_alone(chunk, last)
