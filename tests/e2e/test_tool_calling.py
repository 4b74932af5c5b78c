"""Tool calling on the OpenAI-compatible endpoint, through the official `openai` client and
langchain-openai, unchanged, on the real SmolLM2: a two-tool conversation (call, tool result,
final answer) streamed and not, named and required tool_choice, parallel calls, and 50 varied
requests whose every call parses and validates against its tool's schema (the grammar makes it
so; a 135M model picks odd values, never a wrong shape)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from tests.e2e.tools_cases import ASKS, CONVERSATION_TOOLS, TIME, VARIED, WEATHER, assert_valid_call

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="dev-key", max_retries=0, timeout=300)


def create(client: openai.OpenAI, messages, tools=CONVERSATION_TOOLS, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0, seed=7,
                                          **{"max_tokens": 60, **kw})


def streamed(client: openai.OpenAI, messages, tools=CONVERSATION_TOOLS, **kw) -> tuple[str, list[dict], str]:
    """Content, calls (as OpenAI's deltas assemble them) and finish_reason of a streamed completion;
    asserts each call's first delta brings its index, id, type and name, and later ones only arguments."""
    content, calls, finish = "", {}, None
    for chunk in create(client, messages, tools, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_two_tool_conversation(client, stream):
    if stream:
        _, calls, finish = streamed(client, ASK, tool_choice="required", parallel_tool_calls=False)
    else:
        reply = create(client, ASK, tool_choice="required", parallel_tool_calls=False)
        finish = reply.choices[0].finish_reason
        assert reply.choices[0].message.content is None
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in reply.choices[0].message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1
    arguments = assert_valid_call(CONVERSATION_TOOLS, calls[0]["name"], calls[0]["arguments"])
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": json.dumps({**arguments, "sky": "sunny",
                                                                                   "temperature": 21})}]
    if stream:
        answer, again, finish = streamed(client, history, tool_choice="none")
    else:
        reply = create(client, history, tool_choice="none")
        answer, again, finish = reply.choices[0].message.content, reply.choices[0].message.tool_calls, \
            reply.choices[0].finish_reason
    assert answer and not again and finish in ("stop", "length")


def test_history_is_rendered_into_the_prompt(client):
    first = create(client, ASK, tool_choice="none", max_tokens=1)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    later = create(client, history, tool_choice="none", max_tokens=1)
    # the call and its result are in the prompt (the fallback renders them as text turns)
    assert later.usage.prompt_tokens >= first.usage.prompt_tokens + 20


@pytest.mark.parametrize("choice", ["get_weather", "get_time"])
def test_named_tool_choice(client, choice):
    reply = create(client, ASK, tool_choice={"type": "function", "function": {"name": choice}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == choice and reply.choices[0].finish_reason == "tool_calls"
    assert_valid_call(CONVERSATION_TOOLS, call.function.name, call.function.arguments)


def test_required_on_a_question_the_model_would_answer_in_text(client):
    question = [{"role": "user", "content": "Say hello."}]
    assert create(client, question, tool_choice="auto").choices[0].message.tool_calls is None
    reply = create(client, question, tool_choice="required", parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert_valid_call(CONVERSATION_TOOLS, call.function.name, call.function.arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_calls(client, stream):
    ask = [{"role": "user", "content": "Weather and time in Paris?"}]
    if stream:
        _, calls, _ = streamed(client, ask, tool_choice="required", max_tokens=100)
    else:
        message = create(client, ask, tool_choice="required", max_tokens=100).choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert len(calls) >= 2 and len({c["id"] for c in calls}) == len(calls)
    for call in calls:
        assert_valid_call(CONVERSATION_TOOLS, call["name"], call["arguments"])


def test_fifty_varied_requests_every_call_valid(client):
    def one(i: int):
        tools = [VARIED[i % len(VARIED)], VARIED[(i * 3 + 1) % len(VARIED)]]
        choice = "required" if i % 2 else {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        messages = [{"role": "user", "content": ASKS[i % len(ASKS)]}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                               parallel_tool_calls=False, temperature=0.8, seed=i, max_tokens=72)
        return tools, reply.choices[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(50)))
    finished = 0
    for tools, choice in results:
        for call in choice.message.tool_calls or ():
            assert_valid_call(tools, call.function.name, call.function.arguments)
        if choice.finish_reason == "tool_calls":
            finished += 1
            assert len(choice.message.tool_calls) == 1
        else:
            assert choice.finish_reason == "length" and not choice.message.tool_calls   # cut mid-call
    assert finished >= 40, f"only {finished} of 50 calls finished within max_tokens"


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].name"),
    ({"messages": ASK + [{"role": "tool", "content": "21"}]}, "messages[1].tool_call_id"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].parameters"),
], ids=["unknown-choice", "duplicate", "bad-name", "no-call-id", "bad-schema"])
def test_bad_tool_requests_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{"model": MODEL, "messages": ASK, "tools": CONVERSATION_TOOLS,
                                          "max_tokens": 8, **body})
    assert err.value.body["param"] == param


# -- an agent framework's OpenAI client -------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat(stack) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{stack.http_url}/v1", api_key="dev-key", temperature=0, seed=7,
                      max_tokens=60, max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_bind_tools_conversation(chat, stream):
    bound = chat.bind_tools([WEATHER, TIME], tool_choice="get_weather")
    question = [HumanMessage("What is the weather in Paris, in celsius?")]
    if stream:
        message = None
        for piece in bound.stream(question):
            message = piece if message is None else message + piece
    else:
        message = bound.invoke(question)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert_valid_call(CONVERSATION_TOOLS, call["name"], json.dumps(call["args"]))
    answer = chat.bind_tools([WEATHER, TIME], tool_choice="none").invoke(
        [*question, message, ToolMessage(content="21 C and sunny", tool_call_id=call["id"])])
    assert answer.content and not answer.tool_calls
