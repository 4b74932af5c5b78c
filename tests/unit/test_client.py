"""Client retry and resume bookkeeping (no servers)."""

import random

import grpc
import pytest

from llmserve.client import Chunk, ResumeCursor, RetryPolicy, StreamEnded, build_request, to_chunk
from llmserve.client.results import to_completion
from llmserve.runtime.errors import InvalidArgument, Unavailable
from llmserve.v1 import inference_pb2 as pb


def resp(index, n, final=False):
    return pb.GenerateResponse(request_id="r", index=index, token_ids=list(range(index, index + n)),
                               text=f"<{index}>", finish_reason=pb.FINISH_REASON_LENGTH if final else 0)


def test_cursor_delivers_each_index_once_across_resumes():
    cursor = ResumeCursor()
    assert cursor.metadata() == ()
    first = [resp(0, 2), resp(2, 3)]
    assert [cursor.accept(r) for r in first] == [True, True]
    assert cursor.metadata() == (("x-resume-from", "5"),)
    # a server that ignores x-resume-from replays from 0: the repeats are dropped
    second = [resp(0, 2), resp(2, 3), resp(5, 1), resp(6, 0, final=True)]
    assert [cursor.accept(r) for r in second] == [False, False, True, True]
    assert cursor.finished and cursor.next_index == 6
    assert not cursor.accept(resp(6, 0, final=True))   # a duplicate final after the end


def test_cursor_first_attempt_has_no_resume_header_even_after_retry_before_any_chunk():
    cursor = ResumeCursor()
    assert cursor.metadata() == ()   # a retry with no chunk seen is a plain re-send of the same request_id


def test_backoff_is_full_jitter_and_capped():
    policy = RetryPolicy(max_attempts=10, initial_s=0.1, max_backoff_s=1.0, rng=random.Random(0))
    for attempt in range(8):
        samples = [policy.backoff(attempt) for _ in range(200)]
        cap = min(1.0, 0.1 * 2 ** attempt)
        assert all(0.0 <= s <= cap for s in samples)
        assert max(samples) > cap * 0.8 and min(samples) < cap * 0.2   # spread over the whole range


class FakeRpcError(grpc.RpcError):
    """Only a status code: what the policy looks at."""

    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


@pytest.mark.parametrize("exc, retried", [
    (FakeRpcError(grpc.StatusCode.UNAVAILABLE), True), (StreamEnded(), True), (Unavailable("x"), True),
    (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED), False), (FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT), False),
    (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED), False), (InvalidArgument("f", "r"), False),
])
def test_only_unavailable_is_retried(exc, retried):
    policy = RetryPolicy(max_attempts=3)
    assert (policy.should_retry(exc, 0, None) is not None) is retried


def test_retries_stop_at_max_attempts_and_deadline():
    import time
    policy = RetryPolicy(max_attempts=3, initial_s=10.0, max_backoff_s=10.0, rng=random.Random(1))
    err = FakeRpcError(grpc.StatusCode.UNAVAILABLE)
    assert policy.should_retry(err, 2, None) is None                       # third failure: give up
    assert policy.should_retry(err, 0, time.monotonic() + 1e-6) is None    # no time for the sleep


def test_build_request_leaves_unset_sampling_unset():
    r = build_request(messages=[{"role": "user", "content": "hi"}], max_new_tokens=5, temperature=0.0,
                      priority="high")
    assert r.sampling.HasField("temperature") and r.sampling.temperature == 0.0
    assert not r.sampling.HasField("top_p") and not r.sampling.HasField("seed")
    assert r.priority == pb.PRIORITY_HIGH and len(r.request_id) == 32
    assert build_request("p", request_id="mine").request_id == "mine"


def test_to_chunk_types():
    r = resp(4, 2, final=True)
    r.usage.completion_tokens = 6
    chunk = to_chunk(r)
    assert chunk == Chunk("r", "<4>", (4, 5), 4, "length", chunk.usage) and chunk.usage.completion_tokens == 6
    assert to_chunk(resp(0, 1)).usage is None and to_chunk(resp(0, 1)).finish_reason is None


def test_cursor_of_n_choices_resumes_from_the_lowest_open_choice_and_drops_repeats():
    cursor = ResumeCursor(2)
    a0, b0, a1 = resp(0, 3), resp(0, 1), resp(3, 2)
    b0.choice_index = 1
    assert [cursor.accept(r) for r in (a0, b0, a1)] == [True, True, True]
    assert cursor.metadata() == (("x-resume-from", "1"),)      # choice 1 needs index 1 on
    # the gateway sends every choice's chunks from index 1: choice 0's repeats are dropped
    a_again, b1, a_end = resp(3, 2), resp(1, 2, final=True), resp(5, 0, final=True)
    b1.choice_index = 1
    assert [cursor.accept(r) for r in (a_again, b1)] == [False, True]
    assert not cursor.finished and cursor.metadata() == (("x-resume-from", "5"),)
    assert cursor.accept(a_end) and cursor.finished
    stray = resp(0, 1)
    stray.choice_index = 7
    assert not cursor.accept(stray)


def test_build_request_takes_tools_choices_and_history_in_openai_shape():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                                "strict": True}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    r = build_request(messages=[{"role": "user", "content": "Paris?"},
                                {"role": "assistant", "content": None, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
                      tools=[weather, {"name": "get_time"}], tool_choice="required", parallel_tool_calls=False,
                      n=3, logprobs=True, top_logprobs=2)
    assert [(t.name, t.parameters_json_schema, t.strict) for t in r.tools] == \
        [("get_weather", '{"type": "object"}', True), ("get_time", "", False)]
    assert r.tool_choice.WhichOneof("kind") == "required" and r.HasField("parallel_tool_calls")
    assert not r.parallel_tool_calls and r.n == 3 and r.sampling.logprobs and r.sampling.top_logprobs == 2
    assert list(r.messages[1].tool_calls) == [pb.ToolCall(id="call_1", name="get_weather",
                                                          arguments_json='{"city": "Paris"}')]
    assert (r.messages[1].content, r.messages[2].tool_call_id) == ("", "call_1")
    assert build_request("p", tool_choice="get_time").tool_choice.function_name == "get_time"
    named = build_request("p", tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.tool_choice.function_name == "f" and not build_request("p").HasField("tool_choice")
    assert not build_request("p").HasField("parallel_tool_calls") and build_request("p").n == 0


def test_completion_puts_choice_0_on_top_and_gives_back_its_assistant_turn():
    call = pb.ToolCall(id="call_1", name="f", arguments_json='{"a": 1}')
    reply = pb.CompleteResponse(request_id="r", usage=pb.Usage(completion_tokens=4), choices=[
        pb.CompleteChoice(choice_index=0, text="", token_ids=[1, 2], finish_reason=pb.FINISH_REASON_TOOL_CALLS,
                          tool_calls=[call], logprobs=[pb.TokenLogprob(token_id=1, token="x", logprob=-0.5,
                                                                       top=[pb.TopLogprob(token_id=1, logprob=-0.5)])]),
        pb.CompleteChoice(choice_index=1, text="hi", token_ids=[3, 4], finish_reason=pb.FINISH_REASON_STOP)])
    done = to_completion(reply)
    assert (done.finish_reason, done.token_ids, [c.index for c in done.choices]) == ("tool_calls", (1, 2), [0, 1])
    assert done.tool_calls[0].parsed_arguments() == {"a": 1} and done.logprobs[0].top[0].logprob == -0.5
    assert done.as_message() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert done.choices[1].as_message() == {"role": "assistant", "content": "hi"}
    single = to_completion(pb.CompleteResponse(request_id="r", text="t", finish_reason=pb.FINISH_REASON_LENGTH))
    assert [(c.index, c.text, c.finish_reason) for c in single.choices] == [(0, "t", "length")]
