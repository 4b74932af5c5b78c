"""The Python SDK (llmserve/client/) on the shared stack with real SmolLM2: tools, tool_choice,
parallel_tool_calls, n and logprobs on complete and generate, and a tool-calling stream of several
choices resumed by the SDK across a gateway killed mid-stream."""

from __future__ import annotations

import time

import pytest

from llmserve.client import Client
from tests.e2e.tools_cases import CONVERSATION_TOOLS, assert_valid_call

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
TOOLS = {"tools": CONVERSATION_TOOLS, "max_new_tokens": 60}


@pytest.fixture(scope="module")
def sdk(stack):
    with Client(stack.gateway_target, api_key="dev-key") as client:
        yield client


def per_choice(chunks) -> dict[int, tuple]:
    """choice -> (token ids, (name, arguments) of its calls, finish reason), from a stream's chunks."""
    out = {}
    for i in sorted({c.choice_index for c in chunks}):
        mine = [c for c in chunks if c.choice_index == i]
        assert [c.index for c in mine] == [sum(len(x.token_ids) for x in mine[:k]) for k in range(len(mine))]
        out[i] = (tuple(t for c in mine for t in c.token_ids),
                  tuple((t.name, t.arguments) for c in mine for t in c.tool_calls), mine[-1].finish_reason)
    return out


def test_a_two_tool_conversation(sdk):
    first = sdk.complete(messages=ASK, tool_choice="get_weather", temperature=0.0, **TOOLS)
    assert first.finish_reason == "tool_calls" and first.text == ""
    (call,) = first.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert_valid_call(CONVERSATION_TOOLS, call.name, call.arguments)
    history = [*ASK, first.as_message(), {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    answer = sdk.complete(messages=history, tool_choice="none", temperature=0.0, **TOOLS)
    assert answer.text and not answer.tool_calls and answer.finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_required_single_call_streams_as_it_completes(sdk):
    params = dict(messages=ASK, tool_choice="required", parallel_tool_calls=False, temperature=0.0, **TOOLS)
    whole = sdk.complete(**params)
    chunks = list(sdk.generate(**params))
    assert per_choice(chunks) == {0: (whole.token_ids, tuple((c.name, c.arguments) for c in whole.tool_calls),
                                      "tool_calls")}
    (call,) = whole.tool_calls
    assert_valid_call(CONVERSATION_TOOLS, call.name, call.arguments)


def test_n_choices_with_logprobs(sdk):
    params = dict(messages=[{"role": "user", "content": "Name a fruit."}], n=2, seed=11, temperature=1.0,
                  max_new_tokens=8, logprobs=True, top_logprobs=2)
    whole = sdk.complete(**params)
    assert [c.index for c in whole.choices] == [0, 1] and whole.token_ids == whole.choices[0].token_ids
    for choice in whole.choices:
        assert [lp.token_id for lp in choice.logprobs] == list(choice.token_ids)
        assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in choice.logprobs)
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in whole.choices)
    chunks = list(sdk.generate(**params))
    streamed = per_choice(chunks)
    assert {i: s[0] for i, s in streamed.items()} == {c.index: c.token_ids for c in whole.choices}
    assert [lp for c in chunks if c.choice_index == 1 for lp in c.logprobs] == list(whole.choices[1].logprobs)


def test_a_tool_calling_stream_of_two_choices_resumes_across_a_gateway_restart(sdk, own_gateways):
    params = dict(messages=ASK, tool_choice="required", n=2, seed=5, temperature=1.0, **TOOLS)
    reference = sdk.complete(**params)
    doomed = own_gateways.start_gateway()
    doomed.wait_serving(time.monotonic() + 120)
    chunks = []
    with Client(doomed.target, api_key="dev-key") as client:
        for chunk in client.generate(**params):
            chunks.append(chunk)
            if len(chunks) == 3:
                own_gateways.kill(doomed.name)
                own_gateways.start_gateway(doomed.port).wait_serving(time.monotonic() + 120)
    expected = {c.index: (c.token_ids, tuple((t.name, t.arguments) for t in c.tool_calls), c.finish_reason)
                for c in reference.choices}
    assert len(chunks) > 3 and per_choice(chunks) == expected    # every index and every call exactly once
    for choice in reference.choices:
        assert choice.tool_calls
        for call in choice.tool_calls:
            assert_valid_call(CONVERSATION_TOOLS, call.name, call.arguments)
