"""response_format -> grammar (llmserve.protocol.grammar) and its admission check in the gateway:
invalid formats name `sampling.response_format`, sizes are bounded, repeats hit the cache."""

from __future__ import annotations

import json

import pytest

from gateway.response_format import FormatCompiler
from gateway.validation import RequestLimits, resolve_sampling, validate_request
from gpu_worker.requests import sampling_params, validate_item
from llmserve.protocol.grammar import GrammarCache, GrammarError, grammar_of
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2

LIMITS = RequestLimits()
VALID = [
    pb.ResponseFormat(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    pb.ResponseFormat(regex=r"[a-z]{1,5}@[0-9]+"),
    pb.ResponseFormat(choice=pb.ChoiceList(choices=["yes", "no", "maybe \"so\""])),
    pb.ResponseFormat(json_object=True),
]
INVALID = {
    "schema not JSON": pb.ResponseFormat(json_schema="{'type': 'object'"),
    "schema not an object": pb.ResponseFormat(json_schema="[1, 2]"),
    "unknown type": pb.ResponseFormat(json_schema=json.dumps({"type": "integr"})),
    "dangling $ref": pb.ResponseFormat(json_schema=json.dumps({"$ref": "#/$defs/missing"})),
    "empty bounds": pb.ResponseFormat(json_schema=json.dumps({"type": "integer", "minimum": 5, "maximum": 1})),
    "bad regex": pb.ResponseFormat(regex="[a-z"),
    "no choices": pb.ResponseFormat(choice=pb.ChoiceList()),
    "empty choice": pb.ResponseFormat(choice=pb.ChoiceList(choices=["a", ""])),
    "json_object false": pb.ResponseFormat(json_object=False),
}


def request(fmt: pb.ResponseFormat) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt="hi")
    req.sampling.response_format.CopyFrom(fmt)
    return req


@pytest.mark.parametrize("fmt", VALID, ids=lambda f: f.WhichOneof("kind"))
def test_valid_formats_compile_and_travel_in_the_work_item(fmt):
    assert grammar_of(fmt)
    req = request(fmt)
    validate_request(req, LIMITS)
    resolved = resolve_sampling(req.sampling, 3, 2048, 512, LIMITS)
    assert resolved.response_format == fmt
    item = queue_pb2.WorkItem(prompt_token_ids=[1, 2], sampling=resolved)
    item = queue_pb2.WorkItem.FromString(item.SerializeToString())
    assert validate_item(item, 100) == ""
    assert sampling_params(item).grammar == grammar_of(fmt)


def test_unset_format_is_free_text():
    assert grammar_of(pb.ResponseFormat()) == ""
    resolved = resolve_sampling(pb.SamplingParams(), 3, 2048, 512, LIMITS)
    assert not resolved.HasField("response_format")
    assert sampling_params(queue_pb2.WorkItem(prompt_token_ids=[1], sampling=resolved)).grammar == ""


@pytest.mark.parametrize("name", INVALID)
async def test_invalid_formats_name_the_field(name):
    with pytest.raises(GrammarError):
        grammar_of(INVALID[name])
    validate_request(request(INVALID[name]), LIMITS)      # the cheap checks pass; the compile refuses
    with pytest.raises(InvalidArgument) as err:
        await FormatCompiler(timeout_s=60).check(INVALID[name], "t")
    assert err.value.field == "sampling.response_format"
    assert str(err.value).startswith("sampling.response_format")


def test_worker_refuses_an_item_with_an_invalid_format():
    item = queue_pb2.WorkItem(prompt_token_ids=[1], sampling=queue_pb2.ResolvedSampling(
        response_format=INVALID["bad regex"]))
    assert validate_item(item, 100).startswith("sampling.response_format")


def test_size_limits():
    limits = RequestLimits(max_response_format_bytes=100, max_response_format_choices=3)
    big = pb.ResponseFormat(json_schema=json.dumps({"type": "object", "description": "x" * 200}))
    with pytest.raises(InvalidArgument) as err:
        validate_request(request(big), limits)
    assert err.value.field == "sampling.response_format.json_schema"
    many = pb.ResponseFormat(choice=pb.ChoiceList(choices=["a", "b", "c", "d"]))
    with pytest.raises(InvalidArgument) as err:
        validate_request(request(many), limits)
    assert err.value.field == "sampling.response_format.choice"


async def test_a_repeated_format_is_compiled_once():
    fmt = pb.ResponseFormat(regex=r"unique-[0-9]{7}")
    compiler = FormatCompiler(timeout_s=60)
    for _ in range(5):
        await compiler.check(fmt, "t")
    assert (compiler.cache.hits, compiler.cache.misses) == (4, 1)


def test_cache_is_bounded_and_remembers_failures():
    cache = GrammarCache(capacity=2)
    for i in range(3):
        cache.get(pb.ResponseFormat(regex=f"a{i}"))
    assert len(cache._entries) == 2
    for _ in range(2):
        with pytest.raises(GrammarError):
            cache.get(INVALID["bad regex"])
    assert cache.misses == 4 and cache.hits == 1
