"""`response_format` on the OpenAI-compatible endpoint, through the official `openai` client:
json_schema and json_object map to the same structured output as gRPC; a bad one is a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 40000000}},
          "required": ["city", "population"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]


def test_json_schema_response_format(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_json_object_response_format(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=120,
                                           response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "grammar"},
], ids=["bad-schema", "no-schema", "unknown-type"])
def test_bad_response_format_is_400(client, response_format):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format=response_format)
    assert "response_format" in str(err.value)
