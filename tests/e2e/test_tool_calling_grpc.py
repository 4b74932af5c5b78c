"""Tool calling on gRPC (GenerateRequest.tools / tool_choice / parallel_tool_calls) through the
generated Python client on the real stack: Complete returns the calls, Generate streams each call
whole once complete, a conversation carries calls and tool turns, bad input is INVALID_ARGUMENT."""

from __future__ import annotations

import json
import uuid

import grpc
import pytest

from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc
from tests.e2e.tools_cases import CONVERSATION_TOOLS, VARIED, assert_valid_call

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.gateway_target) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def proto_tools(tools: list[dict]) -> list[pb.Tool]:
    return [pb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                    parameters_json_schema=json.dumps(t["function"]["parameters"])) for t in tools]


def request(messages: list[pb.ChatMessage], choice: pb.ToolChoice, tools=CONVERSATION_TOOLS, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=messages, tools=proto_tools(tools), tool_choice=choice,
                              sampling=pb.SamplingParams(temperature=0, seed=3, max_new_tokens=kw.pop("max_new_tokens",
                                                                                                      60)), **kw)


ASK = [pb.ChatMessage(role="user", content="What is the weather in Paris, in celsius?")]


def test_complete_and_generate_give_the_same_calls(stub, auth_metadata):
    req = request(ASK, pb.ToolChoice(required=True), parallel_tool_calls=False)
    whole = stub.Complete(req, metadata=auth_metadata, timeout=300)
    assert whole.finish_reason == pb.FINISH_REASON_TOOL_CALLS and whole.text == ""
    (call,) = whole.tool_calls
    assert call.id.startswith("call_")
    assert_valid_call(CONVERSATION_TOOLS, call.name, call.arguments_json)
    chunks = list(stub.Generate(req, metadata=auth_metadata, timeout=300))
    streamed = [c for chunk in chunks for c in chunk.tool_calls]
    assert [(c.name, c.arguments_json) for c in streamed] == [(call.name, call.arguments_json)]
    assert all(chunk.text == "" for chunk in chunks)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert sum(len(chunk.token_ids) for chunk in chunks) == len(whole.token_ids)


def test_resume_inside_a_call_gets_it_once(stub, auth_metadata):
    req = request(ASK, pb.ToolChoice(required=True), parallel_tool_calls=False, request_id=f"tools-{uuid.uuid4()}")
    chunks = list(stub.Generate(req, metadata=auth_metadata, timeout=300))
    (done,) = [i for i, chunk in enumerate(chunks) if chunk.tool_calls]
    assert done >= 2                              # the call spans several chunks
    middle = chunks[done - 1].index               # resume after the call began, before it completed
    resumed = list(stub.Generate(req, metadata=(*auth_metadata, ("x-resume-from", str(middle))), timeout=300))
    assert resumed[0].index == middle
    assert [c for chunk in resumed for c in chunk.tool_calls] == list(chunks[done].tool_calls)
    assert resumed[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS


def test_conversation_with_a_tool_turn(stub, auth_metadata):
    first = stub.Complete(request(ASK, pb.ToolChoice(function_name="get_weather")), metadata=auth_metadata,
                          timeout=300)
    (call,) = first.tool_calls
    history = [*ASK, pb.ChatMessage(role="assistant", tool_calls=[call]),
               pb.ChatMessage(role="tool", tool_call_id=call.id, content='{"sky": "sunny", "celsius": 21}')]
    answer = stub.Complete(request(history, pb.ToolChoice(none=True)), metadata=auth_metadata, timeout=300)
    assert answer.text and not answer.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("i", range(len(VARIED)))
def test_varied_schemas_stream_valid_calls(stub, auth_metadata, i):
    tools = [VARIED[i]]
    req = request([pb.ChatMessage(role="user", content="Use the tool.")], pb.ToolChoice(required=True), tools,
                  parallel_tool_calls=False, max_new_tokens=72)
    req.sampling.temperature, req.sampling.seed = 0.8, 100 + i
    chunks = list(stub.Generate(req, metadata=auth_metadata, timeout=300))
    calls = [c for chunk in chunks for c in chunk.tool_calls]
    for call in calls:
        assert_valid_call(tools, call.name, call.arguments_json)
    assert chunks[-1].finish_reason == (pb.FINISH_REASON_TOOL_CALLS if calls else pb.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("change, field", [
    (lambda r: (r.ClearField("messages"), setattr(r, "prompt", "hi")), "tools"),
    (lambda r: r.tool_choice.CopyFrom(pb.ToolChoice(function_name="nope")), "tool_choice"),
    (lambda r: r.tools.add(name="get_time"), "tools[2].name"),
    (lambda r: r.messages.add(role="tool", content="21"), "messages[1].tool_call_id"),
], ids=["plain-prompt", "unknown-choice", "duplicate", "no-call-id"])
def test_invalid_argument_names_the_field(stub, auth_metadata, change, field):
    req = request(ASK, pb.ToolChoice(auto=True))
    change(req)
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(req, metadata=auth_metadata, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)
