"""A streamed tool call that survives kill -9 of its worker: the OpenAI client has already received
the call's id, name and first argument fragments when the worker dies; the request is reclaimed
and re-run on the other worker (same seed, so the same tokens, and the worker's matcher starts
again under the same grammar), and the client ends with exactly one call, its arguments valid and
identical to a fault-free seeded run's."""

from __future__ import annotations

import threading

import openai
import pytest

from llmserve.local.stack import Stack, StackConfig
from tests.conftest import TEST_TENANTS
from tests.e2e.tools_cases import SHORT, assert_valid_call, obj, tool
from tests.fault.test_structured_failover import busiest_worker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Long arguments, so the call is still being written when the first fragment arrives.
PLAN = tool("plan_trip", "Plan a trip", obj(
    stops={"type": "array", "minItems": 3, "maxItems": 3,
           "items": obj(city=SHORT, nights={"type": "integer", "minimum": 1, "maximum": 9})},
    budget={"enum": ["low", "medium", "high"]}))
ASK = [{"role": "user", "content": "Plan a three-city trip through Europe."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = StackConfig(workers=2, device="cpu", port=0, http_port=-1, tenants=TEST_TENANTS,
                         log_dir=tmp_path_factory.mktemp("tool-failover"))
    running = Stack(config).start()
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="dev-key", max_retries=0, timeout=600)


class StreamedCall:
    """One streamed, seeded tool call read in a thread; `started` is set at the call's first delta."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.started = threading.Event()
        self.calls: dict[int, dict] = {}
        self.finish: str | None = None
        self.finished_before_fault = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for chunk in self.client.chat.completions.create(
                    model="smollm2-135m", messages=ASK, tools=[PLAN], tool_choice="required",
                    parallel_tool_calls=False, temperature=0.9, seed=11, max_tokens=160, stream=True):
                for delta in chunk.choices[0].delta.tool_calls or ():
                    entry = self.calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name,
                                                                "arguments": ""})
                    entry["arguments"] += delta.function.arguments or ""
                    self.started.set()
                self.finish = chunk.choices[0].finish_reason or self.finish
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc
        self.started.set()

    def run(self) -> StreamedCall:
        self.thread.start()
        return self

    def join(self) -> StreamedCall:
        self.thread.join(600)
        assert self.error is None, repr(self.error)
        return self


def test_kill9_mid_tool_call(stack, client, inbox_pending):
    baseline = StreamedCall(client).run().join()
    assert baseline.finish == "tool_calls" and len(baseline.calls) == 1
    assert_valid_call([PLAN], baseline.calls[0]["name"], baseline.calls[0]["arguments"])

    faulted = StreamedCall(client).run()
    assert faulted.started.wait(300)
    victim = busiest_worker(stack, inbox_pending)
    sent = len(faulted.calls[0]["arguments"])
    stack.kill(victim)
    assert faulted.finish is None          # the call had begun and not finished: the fault landed mid-call
    faulted.join()
    assert sent < len(faulted.calls[0]["arguments"])
    assert faulted.finish == "tool_calls" and len(faulted.calls) == 1
    call = faulted.calls[0]
    assert_valid_call([PLAN], call["name"], call["arguments"])
    assert (call["name"], call["arguments"]) == (baseline.calls[0]["name"], baseline.calls[0]["arguments"])
