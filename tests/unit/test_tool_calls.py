"""Tool calling in the gateway: the checks (a 400 naming the field), the grammar per tool_choice
(matched over SmolLM2's real vocabulary), and the incremental parser of the calls."""

from __future__ import annotations

import json

import llguidance
import pytest

from gateway.openai_wire import parse_chat
from gateway.response_format import FormatCompiler
from gateway.tool_calls import MAX_TOOLS, Mode, check_tools, grammar_of, mode_of, tool_spec
from gateway.tool_stream import ToolCallParser, ToolCallStream, call_id, openai_deltas
from gateway.validation import RequestLimits, validate_request
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb
from tokenizer_svc.loader import load_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}


def call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def tools_request(choice: pb.ToolChoice | None = None, parallel: bool | None = None, **kw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="weather?")], tools=[
        pb.Tool(name="get_weather", parameters_json_schema=json.dumps(WEATHER)),
        pb.Tool(name="get_time", parameters_json_schema=json.dumps(TIME))], **kw)
    if choice is not None:
        request.tool_choice.CopyFrom(choice)
    if parallel is not None:
        request.parallel_tool_calls = parallel
    return request


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    model = load_tokenizer(smollm2_path)
    return model, llguidance.LLTokenizer(model.to_json(), eos_token=list(model.eos_token_ids))


def accepts(vocab, request: pb.GenerateRequest, text: str) -> bool:
    """Whether the request's grammar takes `text` as a whole completion."""
    model, tokenizer = vocab
    matcher = llguidance.LLMatcher(tokenizer, grammar_of(tool_spec(request)), log_level=0)
    return matcher.consume_tokens(model.encode(text)) and matcher.is_accepting()


# -- checks -----------------------------------------------------------------------------------------------
def bad(**change) -> pb.GenerateRequest:
    request = tools_request()
    for name, value in change.items():
        if name == "tool0":
            request.tools[0].CopyFrom(value)
        elif name == "history":
            del request.messages[:]
            request.messages.extend(value)
        else:
            getattr(request, name).CopyFrom(value) if hasattr(value, "CopyFrom") else setattr(request, name, value)
    return request


BAD = {
    "tools[0].name": bad(tool0=pb.Tool(name="get weather")),
    "tools[1].name": bad(tool0=pb.Tool(name="get_time")),
    "tools[0].parameters": bad(tool0=pb.Tool(name="a", parameters_json_schema='{"type": "string"}')),
    "tools.a.parameters": bad(tool0=pb.Tool(name="a", parameters_json_schema="{nope")),
    "tool_choice": bad(tool_choice=pb.ToolChoice(function_name="missing")),
    "tool_choice.required": bad(tool_choice=pb.ToolChoice(required=False)),
    "sampling.response_format": bad(sampling=pb.SamplingParams(response_format=pb.ResponseFormat(json_object=True))),
    "messages[1].tool_call_id": bad(history=[pb.ChatMessage(role="user", content="x"),
                                             pb.ChatMessage(role="tool", content="22 C")]),
    "messages[0].tool_calls": bad(history=[pb.ChatMessage(role="user", content="x", tool_calls=[
        pb.ToolCall(id="call_1", name="get_time", arguments_json="{}")])]),
    "messages[0].tool_calls[0].function.arguments": bad(history=[pb.ChatMessage(role="assistant", tool_calls=[
        pb.ToolCall(id="call_1", name="get_time", arguments_json="[1]")])]),
}


@pytest.mark.parametrize("field", BAD)
def test_bad_tool_requests_name_the_field(field):
    with pytest.raises(InvalidArgument) as err:
        validate_request(BAD[field], RequestLimits())
    assert err.value.field == field


def test_tools_need_messages_and_fit_the_limits():
    plain = pb.GenerateRequest(prompt="hi", tools=[pb.Tool(name="a")])
    with pytest.raises(InvalidArgument, match="tools"):
        check_tools(plain, 65536)
    many = tools_request()
    many.tools.extend(pb.Tool(name=f"t{i}") for i in range(MAX_TOOLS))
    with pytest.raises(InvalidArgument, match=f"at most {MAX_TOOLS}"):
        check_tools(many, 65536)
    with pytest.raises(InvalidArgument, match="exceed 100 bytes"):
        check_tools(tools_request(), 100)
    with pytest.raises(InvalidArgument, match="tool_choice"):
        check_tools(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x")],
                                       tool_choice=pb.ToolChoice(required=True)), 65536)


async def test_a_schema_that_does_not_compile_names_its_tool():
    request = tools_request()
    request.tools[1].parameters_json_schema = json.dumps({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]})
    validate_request(request, RequestLimits())
    compiler = FormatCompiler(timeout_s=60)
    with pytest.raises(InvalidArgument) as err:
        await compiler.tool_grammar(request, "t")
    assert err.value.field == "tools[1].parameters"
    assert await compiler.tool_grammar(tools_request(), "t")
    assert await compiler.tool_grammar(tools_request(pb.ToolChoice(none=True)), "t") == ""
    compiler.close()


def test_modes():
    assert mode_of(pb.GenerateRequest()) is Mode.NONE
    assert mode_of(tools_request()) is Mode.AUTO
    assert mode_of(tools_request(pb.ToolChoice(none=True))) is Mode.NONE
    assert mode_of(tools_request(pb.ToolChoice(required=True))) is Mode.REQUIRED
    assert mode_of(tools_request(pb.ToolChoice(function_name="get_time"))) is Mode.NAMED
    assert tool_spec(tools_request(pb.ToolChoice(none=True))) is None


# -- grammar ----------------------------------------------------------------------------------------------
PARIS = call("get_weather", {"city": "Paris", "unit": "c"})
ZONE = call("get_time", {"zone": 2})


@pytest.mark.parametrize("text, auto, required, named, single", [
    (PARIS, True, True, False, True),
    (ZONE, True, True, True, True),
    (PARIS + "\n" + ZONE, True, True, False, False),
    (ZONE + "\n" + ZONE, True, True, False, False),
    ("It is sunny.", True, False, False, False),
    ("Sure: " + PARIS, False, False, False, False),                                  # text never holds a call
    (call("get_weather", {"city": "Paris"}), False, False, False, False),             # a required key missing
    (call("get_weather", {"city": "Paris", "unit": "k"}), False, False, False, False),  # not in the enum
    (call("get_time", {"zone": 20}), False, False, False, False),                     # above the maximum
    (call("get_weather", {"city": "Paris", "unit": "c", "x": 1}), False, False, False, False),
    (call("delete_all", {}), False, False, False, False),                             # no such tool
    (PARIS[:-3], False, False, False, False),                                         # not closed
])
def test_grammar_per_tool_choice(vocab, text, auto, required, named, single):
    assert accepts(vocab, tools_request(), text) is auto
    assert accepts(vocab, tools_request(pb.ToolChoice(required=True)), text) is required
    assert accepts(vocab, tools_request(pb.ToolChoice(function_name="get_time")), text) is named
    assert accepts(vocab, tools_request(pb.ToolChoice(required=True), parallel=False), text) is single


def test_an_empty_schema_takes_any_object(vocab):
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x")], tools=[pb.Tool(name="ping")],
                                 tool_choice=pb.ToolChoice(required=True))
    assert accepts(vocab, request, call("ping", {"any": [1, {"deep": "yes"}]}))
    assert not accepts(vocab, request, '<tool_call>{"name": "ping", "arguments": [1]}</tool_call>')


# -- parsing ----------------------------------------------------------------------------------------------
def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


TRICKY = call("get_weather", {"city": 'a "}" b\\', "unit": "c"})


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_parser_finds_the_calls_whatever_the_cut(size):
    parser = ToolCallParser(Mode.AUTO, "req-1")
    events = [e for piece in pieces(TRICKY + "\n" + ZONE, size) for e in parser.feed(piece)] + parser.flush()
    assert [e for e in events if isinstance(e, str)] == []
    assert [(c.id, c.name, json.loads(c.arguments_json)) for c in parser.calls] == [
        (call_id("req-1", 0), "get_weather", {"city": 'a "}" b\\', "unit": "c"}),
        (call_id("req-1", 1), "get_time", {"zone": 2})]
    deltas = openai_deltas(events)
    assert [d.get("id") for d in deltas] == [call_id("req-1", 0), call_id("req-1", 1)]   # merged per call
    assert [d["function"]["arguments"] for d in deltas] == [c.arguments_json for c in parser.calls]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_auto_text_is_content_and_a_call_prefix_waits(size):
    parser = ToolCallParser(Mode.AUTO, "r")
    text = "".join(e for piece in pieces("<tool is a word", size) for e in parser.feed(piece) if isinstance(e, str))
    assert text == "<tool is a word" and not parser.calls
    parser = ToolCallParser(Mode.AUTO, "r")
    assert parser.feed("<tool_") == []
    assert parser.flush() == ["<tool_"]     # ended undecided: it was text


def chunk(text: str, index: int, reason: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r", text=text, index=index, finish_reason=reason)


def test_stream_sends_each_call_whole_and_openai_deltas_in_order():
    stream = ToolCallStream(Mode.REQUIRED, "r")
    outs = [stream.feed(chunk(PARIS[:48], 0)), stream.feed(chunk(PARIS[48:], 5)),
            stream.feed(chunk("", 9, pb.FINISH_REASON_STOP))]
    assert [o.text for o, _ in outs] == ["", "", ""]
    assert [len(o.tool_calls) for o, _ in outs] == [0, 1, 0]
    assert json.loads(outs[1][0].tool_calls[0].arguments_json) == {"city": "Paris", "unit": "c"}
    assert outs[2][0].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    first, second = outs[0][1], outs[1][1]
    assert first == [{"index": 0, "id": call_id("r", 0), "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}]
    assert second == [{"index": 0, "function": {"arguments": '{"city": "Paris", "unit": "c"}'}}]


def test_a_call_cut_by_the_length_limit_is_not_sent():
    stream = ToolCallStream(Mode.REQUIRED, "r")
    out, _ = stream.feed(chunk(PARIS[:-8], 0, pb.FINISH_REASON_LENGTH))
    assert not out.tool_calls and out.finish_reason == pb.FINISH_REASON_LENGTH


def test_auto_text_answer_keeps_stop():
    stream = ToolCallStream(Mode.AUTO, "r")
    out, deltas = stream.feed(chunk("It is sunny.", 0, pb.FINISH_REASON_STOP))
    assert (out.text, out.finish_reason, deltas) == ("It is sunny.", pb.FINISH_REASON_STOP, [])


# -- OpenAI wire --------------------------------------------------------------------------------------------
def test_openai_body_with_tools_and_history():
    body = {"model": "m", "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False}
    request = parse_chat(body).request
    assert request.tools[0].name == "get_weather" and request.tools[0].strict
    assert json.loads(request.tools[0].parameters_json_schema) == WEATHER
    assert request.tool_choice.function_name == "get_weather" and request.parallel_tool_calls is False
    assert request.messages[1].tool_calls[0].id == "call_1"
    assert request.messages[2].tool_call_id == "call_1"
    validate_request(request, RequestLimits())
    assert parse_chat({**body, "tool_choice": "required"}).request.tool_choice.required


@pytest.mark.parametrize("change, field", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_openai_tool_fields_of_the_wrong_type(change, field):
    body = {"messages": [{"role": "user", "content": "x"}], **change}
    with pytest.raises(InvalidArgument) as err:
        parse_chat(body)
    assert err.value.field == field
