"""Tools shared by the tool-calling tests (OpenAI's shape), and the check that a call is valid."""

from __future__ import annotations

import json

import jsonschema

SHORT = {"type": "string", "maxLength": 12}


def obj(required: list[str] | None = None, **properties) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


WEATHER = tool("get_weather", "Current weather of a city", obj(city=SHORT, unit={"enum": ["celsius", "fahrenheit"]}))
TIME = tool("get_time", "Current local time of a city", obj(city=SHORT))
CONVERSATION_TOOLS = [WEATHER, TIME]

# Varied schemas: nested objects, enums, arrays, bounded numbers, optional and required fields.
VARIED = [
    tool("book_flight", "Book a flight", obj(origin=SHORT, destination=SHORT,
                                             passengers={"type": "integer", "minimum": 1, "maximum": 9})),
    tool("set_alarm", "Set an alarm", obj(["hour", "minute"], hour={"type": "integer", "minimum": 0, "maximum": 23},
                                          minute={"type": "integer", "minimum": 0, "maximum": 59},
                                          label=SHORT)),
    tool("add_todo", "Add items to a todo list", obj(items={"type": "array", "items": SHORT, "minItems": 1,
                                                            "maxItems": 3},
                                                     priority={"enum": ["low", "medium", "high"]})),
    tool("create_user", "Create a user account", obj(name=SHORT, address=obj(street=SHORT, zip={
        "type": "string", "pattern": "^[0-9]{5}$"}), admin={"type": "boolean"})),
    tool("convert", "Convert an amount of money", obj(amount={"type": "number", "minimum": 0, "maximum": 1e6},
                                                      currency={"enum": ["USD", "EUR", "JPY"]})),
    tool("rate_movie", "Rate a movie", obj(["title", "stars"], title=SHORT,
                                           stars={"type": "integer", "minimum": 1, "maximum": 5},
                                           tags={"type": "array", "items": {"enum": ["fun", "sad", "long"]},
                                                 "maxItems": 2})),
    tool("move_robot", "Move a robot on a grid", obj(steps={"type": "array", "minItems": 1, "maxItems": 2,
                                                            "items": obj(dx={"type": "integer", "minimum": -5,
                                                                             "maximum": 5},
                                                                         dy={"type": "integer", "minimum": -5,
                                                                             "maximum": 5})})),
    tool("search", "Search the web", {"type": "object", "properties": {"query": SHORT}, "required": ["query"]}),
    tool("ping", "Check that a host is up", {"type": "object", "properties": {}, "additionalProperties": False}),
    tool("send_email", "Send an email", obj(to={"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                                            urgent={"type": "boolean"}, subject=SHORT)),
]
ASKS = ["Please help me with this.", "Do it for Alice in Paris now.", "Use the tool with sensible values.",
        "I need this done for tomorrow morning.", "Go ahead, numbers are up to you."]


def schema_of(tools: list[dict], name: str) -> dict:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def assert_valid_call(tools: list[dict], name: str, arguments: str) -> dict:
    """The call names one of `tools` and its arguments parse and validate against that tool's schema."""
    assert name in {t["function"]["name"] for t in tools}
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, schema_of(tools, name))
    return parsed
