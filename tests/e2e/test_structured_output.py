"""Structured output through the whole stack on the real SmolLM2: 20 JSON schemas whose every
output validates with `jsonschema`, regex, choice, json_object, invalid formats refused with
INVALID_ARGUMENT naming the field, and a seeded constrained request identical whatever shares
its batch. (Failover and drain: tests/fault/test_structured_failover.py.)"""

from __future__ import annotations

import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from llmserve.client import Client
from llmserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 160
NAME = {"type": "string", "maxLength": 16}
SHORT = {"type": "string", "maxLength": 10}


def obj(required: list[str] | None = None, **properties) -> dict:
    return {"type": "object", "properties": properties, "required": required if required is not None else
            list(properties), "additionalProperties": False}


SCHEMAS = [
    ("a person", obj(name=NAME, age={"type": "integer", "minimum": 0, "maximum": 120})),
    ("a product", obj(title=NAME, price={"type": "number", "minimum": 0, "maximum": 1000}, in_stock={"type": "boolean"})),
    ("a color", obj(color={"enum": ["red", "green", "blue"]})),
    ("a city", obj(city=NAME, country=NAME, population={"type": "integer", "minimum": 1, "maximum": 50000000})),
    ("a shopping list", obj(items={"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3})),
    ("a book", obj(title=NAME, author=obj(first=SHORT, last=SHORT), year={"type": "integer", "minimum": 1400,
                                                                           "maximum": 2030})),
    ("a dice roll", obj(roll={"type": "integer", "minimum": 1, "maximum": 6})),
    ("a temperature reading", obj(celsius={"type": "number", "minimum": -50, "maximum": 60},
                                  unit={"const": "C"})),
    ("a pet", obj(kind={"enum": ["cat", "dog", "fish"]}, name=NAME, vaccinated={"type": "boolean"})),
    ("a point", obj(x={"type": "integer", "minimum": -100, "maximum": 100},
                    y={"type": "integer", "minimum": -100, "maximum": 100})),
    ("a task", obj(["title", "done"], title=NAME, done={"type": "boolean"},
                   priority={"enum": ["low", "medium", "high"]})),
    ("a team", obj(name=NAME, members={"type": "array", "items": obj(name=SHORT), "minItems": 1, "maxItems": 2})),
    ("a rating", obj(stars={"type": "integer", "minimum": 1, "maximum": 5}, comment=NAME)),
    ("a date", obj(year={"type": "integer", "minimum": 1900, "maximum": 2100},
                   month={"type": "integer", "minimum": 1, "maximum": 12},
                   day={"type": "integer", "minimum": 1, "maximum": 31})),
    ("a yes or no answer", obj(answer={"type": "boolean"})),
    ("a list of numbers", obj(values={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "minItems": 2, "maxItems": 4})),
    ("a traffic light state", obj(light={"enum": ["red", "yellow", "green"]}, seconds={"type": "integer",
                                                                                       "minimum": 0, "maximum": 90})),
    ("an address", obj(street=NAME, zip={"type": "string", "pattern": "^[0-9]{5}$"})),
    ("a weather report", obj(sky={"enum": ["sunny", "cloudy", "rainy"]},
                             wind=obj(speed={"type": "integer", "minimum": 0, "maximum": 200},
                                      direction={"enum": ["N", "E", "S", "W"]}))),
    ("a user account", obj(["username", "roles"], username=SHORT,
                           roles={"type": "array", "items": {"enum": ["admin", "editor", "viewer"]},
                                  "minItems": 1, "maxItems": 3}, email=NAME)),
]


@pytest.fixture(scope="module")
def client(stack):
    client = Client(stack.gateway_target, api_key="dev-key")
    yield client
    client.close()


def ask(client: Client, prompt: str, fmt: pb.ResponseFormat, **params):
    params.setdefault("max_new_tokens", MAX_NEW_TOKENS)
    params.setdefault("temperature", 0.0)
    return client.complete(messages=[{"role": "user", "content": prompt}], response_format=fmt, timeout=300,
                           **params)


def test_twenty_schemas_every_output_validates(client):
    def one(i: int):
        what, schema = SCHEMAS[i]
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i}
        return ask(client, f"Reply with {what} as JSON.", pb.ResponseFormat(json_schema=json.dumps(schema)),
                   **sampling)

    assert len(SCHEMAS) == 20
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        replies = list(pool.map(one, range(len(SCHEMAS))))
    for (what, schema), reply in zip(SCHEMAS, replies):
        assert reply.finish_reason == "stop", (what, reply.text)
        jsonschema.validate(json.loads(reply.text), schema)


def test_regex_choice_and_json_object(client):
    regex = r"[A-Z]{3}-[0-9]{4}"
    reply = ask(client, "Invent a licence plate.", pb.ResponseFormat(regex=regex), temperature=0.7, seed=3)
    assert re.fullmatch(regex, reply.text), reply.text
    choices = ["positive", "negative", "neutral"]
    reply = ask(client, "Is 'I love this!' positive or negative?", pb.ResponseFormat(choice=pb.ChoiceList(
        choices=choices)))
    assert reply.text in choices
    assert reply.finish_reason == "stop"
    reply = ask(client, "Describe a car as a JSON object.", pb.ResponseFormat(json_object=True),
                max_new_tokens=64)
    if reply.finish_reason == "stop":   # any object: its length is the model's choice, not the grammar's
        assert isinstance(json.loads(reply.text), dict)
    else:
        assert reply.text.startswith("{")


@pytest.mark.parametrize("fmt", [
    pb.ResponseFormat(json_schema="{not json"),
    pb.ResponseFormat(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "strng"}}})),
    pb.ResponseFormat(regex="(unclosed"),
    pb.ResponseFormat(choice=pb.ChoiceList()),
    pb.ResponseFormat(json_object=False),
    pb.ResponseFormat(json_schema=json.dumps({"type": "object", "description": "x" * 70_000})),
], ids=["not-json", "bad-type", "bad-regex", "no-choices", "json-object-false", "too-big"])
def test_invalid_formats_are_invalid_argument(inference, auth_metadata, client, fmt):
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_new_tokens=4, response_format=fmt),
                                 request_id="bad-format-" + uuid.uuid4().hex[:8])
    with pytest.raises(grpc.RpcError) as err:
        inference.Complete(request, metadata=auth_metadata, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.response_format" in err.value.details()
    assert ask(client, "Say yes.", pb.ResponseFormat(choice=pb.ChoiceList(choices=["yes"]))).text == "yes"


def test_seeded_constrained_request_same_across_batch_compositions(client):
    what, schema = SCHEMAS[11]
    fmt = pb.ResponseFormat(json_schema=json.dumps(schema))
    target = {"temperature": 1.0, "seed": 2024}
    alone = ask(client, f"Reply with {what} as JSON.", fmt, **target)

    def other(i: int):
        other_what, other_schema = SCHEMAS[i]
        if i % 2:
            return ask(client, f"Reply with {other_what} as JSON.", pb.ResponseFormat(
                json_schema=json.dumps(other_schema)), temperature=0.9, seed=i)
        return client.complete(f"Tell me about {other_what}.", max_new_tokens=40 + i, timeout=300)

    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(other, i) for i in range(5)]
        crowded = pool.submit(ask, client, f"Reply with {what} as JSON.", fmt, **target).result()
        [f.result() for f in others]
    assert crowded.token_ids == alone.token_ids
    jsonschema.validate(json.loads(alone.text), schema)
