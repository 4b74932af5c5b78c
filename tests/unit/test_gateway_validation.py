"""Every validation rule of the gateway: INVALID_ARGUMENT and the field it names."""

import grpc
import pytest

from gateway.bad_utf8 import SCHEMAS, Unparsable, lenient, locate_bad_utf8
from gateway.validation import RequestLimits, check_input, resolve_sampling, validate_request
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb

LIMITS = RequestLimits(max_prompt_bytes=100, max_messages=3, max_stop_strings=8, max_stop_chars=5,
                       max_request_id_chars=10, default_max_new_tokens=256)


def make_request(**kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    kw.setdefault("prompt", "hi")
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **kw)


def field_of(request) -> str:
    with pytest.raises(InvalidArgument) as err:
        validate_request(request, LIMITS)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.field


@pytest.mark.parametrize("kw, field", [
    (dict(prompt=""), "prompt"),                                                   # neither
    (dict(messages=[pb.ChatMessage(role="user", content="x")]), "prompt"),         # both
    (dict(prompt="x" * 101), "prompt"),                                            # too long
    (dict(prompt="", messages=[pb.ChatMessage(role="robot", content="x")]), "messages[0].role"),
    (dict(prompt="", messages=[pb.ChatMessage(role="user", content="a")] * 4), "messages"),
    (dict(prompt="", messages=[pb.ChatMessage(role="user", content="a" * 60)] * 2), "messages"),
    (dict(sampling=dict(temperature=-0.1)), "sampling.temperature"),
    (dict(sampling=dict(temperature=float("nan"))), "sampling.temperature"),
    (dict(sampling=dict(top_p=0.0)), "sampling.top_p"),
    (dict(sampling=dict(top_p=1.01)), "sampling.top_p"),
    (dict(sampling=dict(top_k=-1)), "sampling.top_k"),
    (dict(sampling=dict(repetition_penalty=0.0)), "sampling.repetition_penalty"),
    (dict(sampling=dict(max_new_tokens=0)), "sampling.max_new_tokens"),
    (dict(sampling=dict(stop=["a"] * 9)), "sampling.stop"),
    (dict(sampling=dict(stop=["ok", ""])), "sampling.stop[1]"),
    (dict(sampling=dict(stop=["toolong"])), "sampling.stop[0]"),
    (dict(request_id="has space"), "request_id"),
    (dict(request_id="{tag}"), "request_id"),
    (dict(request_id="x" * 11), "request_id"),
    (dict(priority=7), "priority"),
])
def test_rule_names_field(kw, field):
    assert field_of(make_request(**kw)) == field


def test_valid_request_passes():
    validate_request(make_request(request_id="ok-1.a:b", sampling=dict(
        temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=1, stop=["a"] * 8, repetition_penalty=1.1)), LIMITS)


def test_tokenize_text_xor_messages_names_text():
    with pytest.raises(InvalidArgument) as err:
        check_input("", [], LIMITS, prompt_field="text")
    assert err.value.field == "text"


def resolve(sampling: dict, prompt_tokens=10, context=100, cap=50):
    return resolve_sampling(pb.SamplingParams(**sampling), prompt_tokens, context, cap, LIMITS)


def test_max_new_tokens_over_tenant_cap():
    with pytest.raises(InvalidArgument) as err:
        resolve(dict(max_new_tokens=51))
    assert err.value.field == "sampling.max_new_tokens" and "tenant cap" in err.value.message


def test_max_new_tokens_over_context():
    with pytest.raises(InvalidArgument) as err:
        resolve(dict(max_new_tokens=40), prompt_tokens=70)
    assert err.value.field == "sampling.max_new_tokens" and "context" in err.value.message


def test_prompt_fills_context():
    with pytest.raises(InvalidArgument) as err:
        resolve({}, prompt_tokens=100)
    assert err.value.field == "prompt"


def test_defaults_resolved():
    s = resolve({}, prompt_tokens=90)
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert s.max_new_tokens == 10                                  # min(256, cap 50, room 10)
    assert resolve({}).max_new_tokens == 50                         # tenant cap
    s = resolve(dict(temperature=0.0, seed=7, max_new_tokens=5))
    assert (s.temperature, s.seed, s.max_new_tokens) == (0.0, 7, 5)


@pytest.mark.parametrize("raw, field", [
    (pb.GenerateRequest(prompt="P", request_id="r").SerializeToString().replace(b"P", b"\xff"), "prompt"),
    (pb.GenerateRequest(request_id="Q").SerializeToString().replace(b"Q", b"\xc3"), "request_id"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="ok"),
                                  pb.ChatMessage(role="user", content="Z")]).SerializeToString()
     .replace(b"Z", b"\xe2\x82"), "messages[1].content"),
    (pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(stop=["a", "W"])).SerializeToString()
     .replace(b"W", b"\x80"), "sampling.stop[1]"),
])
def test_invalid_utf8_on_the_wire_names_field(raw, field):
    parsed = lenient(pb.GenerateRequest)(raw)
    assert isinstance(parsed, Unparsable)
    assert parsed.error.field == field
    assert locate_bad_utf8(raw, SCHEMAS["GenerateRequest"]) == field


def test_garbage_bytes_name_the_request():
    parsed = lenient(pb.GenerateRequest)(b"\x0a\xff\xff\xff\xff\xff")
    assert isinstance(parsed, Unparsable) and parsed.error.field == "request"
