"""Gateway side of logprobs: field checks (400 naming the field), token texts from the real SmolLM2
tokenizer, the chunks' entries, and OpenAI's chat and legacy shapes."""

from __future__ import annotations

import pytest

from gateway import logprobs
from gateway.detokenizer import TokenTexts
from gateway.openai_wire import parse_chat, parse_completion
from gateway.output import OutputBuilder
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2
from tokenizer_svc.loader import load_tokenizer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path).tokenizer


def test_token_bytes_rebuild_the_text_even_inside_a_character(tokenizer):
    text = "naïve 🤖 café"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    texts = TokenTexts(tokenizer)
    assert b"".join(texts.bytes_of(i) for i in ids).decode("utf-8") == text
    robot = tokenizer.encode("🤖", add_special_tokens=False).ids
    assert len(robot) > 1 and "\ufffd" in texts.text_of(robot[0])   # a token alone: part of a character


def test_builder_gives_each_new_token_its_entry_with_text(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False).ids
    entries = [pb.TokenLogprob(token_id=t, logprob=-0.5 * k, top=[pb.TopLogprob(token_id=t, logprob=-0.5 * k)])
               for k, t in enumerate(ids)]
    builder = OutputBuilder("r", tokenizer, [])
    first = builder.feed(queue_pb2.TokenEvent(index=0, token_ids=ids[:1], logprobs=entries[:1]))
    # a redelivery repeats token 0: only the new token's entry comes out
    second = builder.feed(queue_pb2.TokenEvent(index=0, token_ids=ids, logprobs=entries, final=True,
                                               finish_reason=pb.FINISH_REASON_LENGTH))
    assert [e.token for e in first.logprobs] == [tokenizer.decode(ids[:1])]
    assert [e.token_id for e in second.logprobs] == ids[1:] and second.logprobs[0].top[0].token == " world"
    assert second.logprobs[0].logprob == pytest.approx(-0.5)


@pytest.mark.parametrize(("body", "field"), [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": 2}, "logprobs"),
    ({"n": 0}, "n"),
])
def test_chat_fields_out_of_range_name_the_field(body, field):
    with pytest.raises(InvalidArgument) as err:
        parse_chat({**CHAT, **body})
    assert err.value.field == field


def test_legacy_logprobs_is_an_integer_up_to_5():
    sampling = parse_completion({"prompt": "x", "logprobs": 3}).request.sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 3)
    with pytest.raises(InvalidArgument) as err:
        parse_completion({"prompt": "x", "logprobs": 6})
    assert err.value.field == "logprobs"


def test_grpc_top_logprobs_is_checked_by_the_shared_validation():
    with pytest.raises(InvalidArgument) as err:
        logprobs.check(pb.SamplingParams(logprobs=True, top_logprobs=21))
    assert err.value.field == "sampling.top_logprobs"
    logprobs.check(pb.SamplingParams(logprobs=True, top_logprobs=20))


def test_openai_shapes():
    entries = [pb.TokenLogprob(token="He", logprob=-0.1, top=[pb.TopLogprob(token="He", logprob=-0.1),
                                                              pb.TopLogprob(token="Hi", logprob=-2.5)]),
               pb.TokenLogprob(token="llo", logprob=-0.2)]
    chat = logprobs.chat_content(entries)
    assert chat["content"][0] == {"token": "He", "logprob": pytest.approx(-0.1), "bytes": [72, 101],
                                  "top_logprobs": [{"token": "He", "logprob": pytest.approx(-0.1), "bytes": [72, 101]},
                                                   {"token": "Hi", "logprob": pytest.approx(-2.5), "bytes": [72, 105]}]}
    legacy, offset = logprobs.completion_logprobs(entries, 4)
    assert legacy["tokens"] == ["He", "llo"] and legacy["text_offset"] == [4, 6] and offset == 9
    assert legacy["top_logprobs"][0] == {"He": pytest.approx(-0.1), "Hi": pytest.approx(-2.5)}
