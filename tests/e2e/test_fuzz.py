"""Bad input: thousands of random and mutated requests get only the status codes the API allows,
and every service is still SERVING and answering afterwards. The OpenAI HTTP port too: nesting,
bad UTF-8, odd content types, wrong types in every field and bodies over the limit get a 4xx JSON
error (or a 200), never a 5xx, and it still answers afterwards.

Runs on the shared stack when that uses tests/data/tenants.test.yaml (tenant "fuzz", key "fuzz-key": quotas
high enough that requests reach validation; completions capped at 4 tokens), else on a stack of its own.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:Generating overly large repr")]

FUZZ_AUTH = (("authorization", "Bearer fuzz-key"),)
TEST_TENANTS = Path(__file__).resolve().parents[1] / "data" / "tenants.test.yaml"
ALLOWED = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
})
MB = 1024 * 1024
CLIENT_OPTIONS = [("grpc.max_send_message_length", 64 * MB), ("grpc.max_receive_message_length", 64 * MB)]
PARALLEL = 16
TIMEOUT_S = 90.0
COMPLETE = "/llmserve.v1.Inference/Complete"
GENERATE = "/llmserve.v1.Inference/Generate"

# Every outcome of the module, for the meaningfulness checks at the end.
TALLY: Counter = Counter()


class Outcome:
    def __init__(self, label: str, code: grpc.StatusCode, details: str, wire_ok: bool = True) -> None:
        self.label, self.code, self.details, self.wire_ok = label, code, details or "", wire_ok

    def allowed(self) -> bool:
        if self.code in ALLOWED:
            return True
        # gRPC's own answer to bytes that are no valid message is not the service's to choose.
        return not self.wire_ok and self.code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) \
            and ("pars" in self.details.lower() or "deserializ" in self.details.lower())

    def __repr__(self) -> str:
        return f"{self.label}: {self.code.name} {self.details[:200]!r}"


def knows_fuzz_tenant(target: str) -> bool:
    with grpc.insecure_channel(target) as ch:
        try:
            inference_pb2_grpc.InferenceStub(ch).ListModels(pb.ListModelsRequest(), metadata=FUZZ_AUTH, timeout=30)
            return True
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return False
            raise


@pytest.fixture(scope="module")
def fuzz_stack(stack, tmp_path_factory):
    """The shared stack when it runs with tests/data/tenants.test.yaml; otherwise a stack of our own that does."""
    if knows_fuzz_tenant(stack.gateway_target):
        yield stack
        return
    from llmserve.local.stack import Stack, StackConfig

    own = Stack(StackConfig(workers=1, device="cpu", port=0, http_port=-1, tenants=TEST_TENANTS,
                            log_dir=tmp_path_factory.mktemp("fuzz-stack")))
    try:
        yield own.start()
    finally:
        own.close()


@pytest.fixture(scope="module")
def channel(fuzz_stack):
    with grpc.insecure_channel(fuzz_stack.gateway_target, options=CLIENT_OPTIONS) as ch:
        yield ch


@pytest.fixture(scope="module")
def inference(channel):
    return inference_pb2_grpc.InferenceStub(channel)


def call(stub_method, request, metadata=FUZZ_AUTH, label: str = "", wire_ok: bool = True) -> Outcome:
    """Send one request (unary or streaming, drained) and return how it ended."""
    try:
        reply = stub_method(request, metadata=metadata, timeout=TIMEOUT_S)
        if isinstance(reply, grpc.Call):  # a stream: drain it
            for _ in reply:
                pass
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    TALLY[code] += 1
    return Outcome(label or repr(request)[:300], code, details, wire_ok)


def run_all(jobs) -> list[Outcome]:
    """jobs: callables returning an Outcome; run PARALLEL at a time."""
    with ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(lambda job: job(), jobs))


def assert_allowed(outcomes: list[Outcome]) -> None:
    bad = [o for o in outcomes if not o.allowed()]
    assert bad == [], f"{len(bad)} disallowed outcomes, first ones: {bad[:5]}"


# -- hypothesis strategies -----------------------------------------------------------------------------
SPECIAL_TEXT = ["", " ", "\x00", "\x00\x01\x02", "\u202e\u200b\ufeff", "😀" * 50, "a" * 5000, "{}:{}",
                "<|im_start|>system\n", "<|endoftext|>", "\n" * 200, "%s%n%x", "' OR 1=1 --", "\\u0000"]
texts = st.one_of(st.text(st.characters(codec="utf-8"), max_size=60), st.sampled_from(SPECIAL_TEXT))
floats32 = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, 0.7, -1.0, 1e-45, 3.4e38, 2.0,
                                                             math.nan, math.inf, -math.inf]))
small_tokens = st.one_of(st.integers(0, 2), st.sampled_from([2**32 - 1, 2**31, 100000, 257]))
MODELS = ["", "smollm2-135m", "SMOLLM2-135M", "no-such-model", "../../etc/passwd", "*", "smollm2-135m "]


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    params = pb.SamplingParams()
    for name, strategy in (("temperature", floats32), ("top_p", floats32), ("repetition_penalty", floats32),
                           ("top_k", st.integers(-2**31, 2**31 - 1)), ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(params, name, draw(strategy))
    # Always bound the completion: fuzzing validation, not throughput.
    params.max_new_tokens = draw(small_tokens)
    params.stop.extend(draw(st.lists(texts, max_size=draw(st.sampled_from([0, 2, 12])))))
    return params


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        model=draw(st.one_of(st.sampled_from(MODELS), texts)),
        sampling=draw(sampling_params()),
        request_id=draw(st.one_of(st.just(""), texts, st.text("abc-_.:{}/ ", min_size=1, max_size=200))),
        priority=draw(st.sampled_from([0, 1, 2, 3, -1, 4, 99, 2**31 - 1])),
    )
    shape = draw(st.sampled_from(["prompt", "messages", "both", "neither"]))
    if shape in ("prompt", "both"):
        request.prompt = draw(texts)
    if shape in ("messages", "both"):
        roles = st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), texts)
        for _ in range(draw(st.integers(0, 6))):
            request.messages.add(role=draw(roles), content=draw(texts))
    return request


@st.composite
def metadata(draw) -> tuple:
    return draw(st.sampled_from([
        FUZZ_AUTH, FUZZ_AUTH, FUZZ_AUTH, FUZZ_AUTH, (), (("authorization", "Bearer"),),
        (("authorization", "Basic fuzz-key"),), (("authorization", "Bearer  fuzz-key  "),),
        (("authorization", "bearer fuzz-key"),), (("authorization", "Bearer wrong"),),
        (*FUZZ_AUTH, ("x-resume-from", "-1")), (*FUZZ_AUTH, ("x-resume-from", "abc")),
        (*FUZZ_AUTH, ("x-resume-from", "99999999999999999999")), (*FUZZ_AUTH, ("x-resume-from", "3")),
        (*FUZZ_AUTH, ("authorization", "Bearer other")), (*FUZZ_AUTH, ("x-request-id", "spoofed")),
        (("authorization-bin", b"\xff\x00"),), (*FUZZ_AUTH, ("x-junk-bin", b"\x00" * 1000)),
    ]))


def fuzz_hypothesis(inference, examples: int, batch: int, rpc: str) -> int:
    """Send examples×batch hypothesis requests, PARALLEL at a time; returns how many went out."""
    sent = 0
    method = inference.Complete if rpc == "complete" else inference.Generate

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(generate_requests(), metadata()), min_size=batch, max_size=batch))
    def run(cases):
        nonlocal sent
        outcomes = run_all([lambda r=r, m=m: call(method, r, m) for r, m in cases])
        sent += len(outcomes)
        assert_allowed(outcomes)

    run()
    return sent


# -- tests ---------------------------------------------------------------------------------------------
def test_hypothesis_complete_requests(inference):
    assert fuzz_hypothesis(inference, examples=30, batch=40, rpc="complete") == 1200


def test_hypothesis_generate_requests(inference):
    assert fuzz_hypothesis(inference, examples=10, batch=40, rpc="generate") == 400


def test_other_rpcs_with_random_input(inference):
    rng = random.Random(11)
    words = ["", "x", "a" * 300, "{t}:{r}", "\x00", "😀", "sec-cancel-1", " " * 3, "../", "id\nnewline"]
    jobs = []
    for i in range(120):
        word = rng.choice(words) + str(i) * rng.randint(0, 1)
        jobs.append(lambda w=word: call(inference.Cancel, pb.CancelRequest(request_id=w)))
        jobs.append(lambda w=word: call(inference.Tokenize, pb.TokenizeRequest(model=rng.choice(MODELS), text=w)))
        jobs.append(lambda w=word: call(inference.Tokenize, pb.TokenizeRequest(
            text=w, messages=[pb.ChatMessage(role=w, content=w)])))
    jobs.append(lambda: call(inference.ListModels, pb.ListModelsRequest(), metadata=()))
    assert_allowed(run_all(jobs))


def valid_request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hello there", sampling=pb.SamplingParams(max_new_tokens=2, **sampling))


def hand_built_cases() -> list[tuple[str, pb.GenerateRequest, tuple]]:
    """Named edge cases: huge inputs, bad numbers, unknown models, bad request ids and metadata."""
    cases = [
        ("prompt 900 KB", pb.GenerateRequest(prompt="word " * 180_000, sampling=pb.SamplingParams(max_new_tokens=1)),
         FUZZ_AUTH),
        ("prompt 1.5 MB", pb.GenerateRequest(prompt="x" * (3 * MB // 2)), FUZZ_AUTH),
        ("prompt 10 MB", pb.GenerateRequest(prompt="y" * (10 * MB)), FUZZ_AUTH),
        ("message 20 MB (above the server's max)", pb.GenerateRequest(prompt="z" * (20 * MB)), FUZZ_AUTH),
        ("10 MB stop string", valid_request(stop=["s" * (10 * MB)]), FUZZ_AUTH),
        ("2000 messages", pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")] * 2000),
         FUZZ_AUTH),
        ("10 MB in messages", pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="m" * MB)] * 10),
         FUZZ_AUTH),
        ("100 stop strings", valid_request(stop=["a"] * 100), FUZZ_AUTH),
        ("unknown model", pb.GenerateRequest(model="gpt-17", prompt="hi"), FUZZ_AUTH),
        ("model path", pb.GenerateRequest(model="/etc/passwd", prompt="hi"), FUZZ_AUTH),
        ("request_id 10 KB", pb.GenerateRequest(prompt="hi", request_id="r" * 10_000), FUZZ_AUTH),
        ("request_id braces", pb.GenerateRequest(prompt="hi", request_id="{r:other:x}"), FUZZ_AUTH),
        ("request_id newline", pb.GenerateRequest(prompt="hi", request_id="a\nb"), FUZZ_AUTH),
        ("request_id NUL", pb.GenerateRequest(prompt="hi", request_id="a\x00b"), FUZZ_AUTH),
        ("no auth", valid_request(), ()),
        ("empty bearer", valid_request(), (("authorization", "Bearer "),)),
        ("two auth headers", valid_request(), (*FUZZ_AUTH, ("authorization", "Bearer nope"))),
        ("resume from huge", valid_request(), (*FUZZ_AUTH, ("x-resume-from", "18446744073709551616"))),
        ("resume from float", valid_request(), (*FUZZ_AUTH, ("x-resume-from", "1.5"))),
    ]
    for name, value in (("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("negative", -1.0),
                        ("huge", 3.4e38), ("zero", 0.0)):
        for field in ("temperature", "top_p", "repetition_penalty"):
            cases.append((f"{field} {name}", valid_request(**{field: value}), FUZZ_AUTH))
    for top_k in (-1, -2**31, 2**31 - 1):
        cases.append((f"top_k {top_k}", valid_request(top_k=top_k), FUZZ_AUTH))
    for tokens in (0, 2**32 - 1):
        cases.append((f"max_new_tokens {tokens}",
                      pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_new_tokens=tokens)), FUZZ_AUTH))
    cases.append(("seed max", valid_request(seed=2**64 - 1), FUZZ_AUTH))
    return cases


def test_hand_built_edge_cases(inference):
    jobs = []
    for name, request, meta in hand_built_cases():
        for method in (inference.Complete, inference.Generate):
            jobs.append(lambda n=name, r=request, m=meta, f=method: call(f, r, m, label=n))
    outcomes = run_all(jobs)
    assert_allowed(outcomes)
    by_label = {o.label: o.code for o in outcomes}
    assert by_label["no auth"] == grpc.StatusCode.UNAUTHENTICATED
    assert by_label["prompt 10 MB"] == grpc.StatusCode.INVALID_ARGUMENT
    assert by_label["temperature nan"] == grpc.StatusCode.INVALID_ARGUMENT
    assert by_label["unknown model"] in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


# -- raw bytes on the wire -------------------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


BAD_UTF8 = [b"\xff\xfe", b"abc\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"ok\x80ok"]


def bad_utf8_messages() -> list[tuple[str, bytes]]:
    """Serialized GenerateRequests with invalid UTF-8 in each kind of string field."""
    out = []
    for i, bad in enumerate(BAD_UTF8):
        out += [
            (f"bad utf8 model {i}", field_bytes(1, bad) + field_bytes(2, b"hi")),
            (f"bad utf8 prompt {i}", field_bytes(2, bad)),
            (f"bad utf8 message content {i}", field_bytes(3, field_bytes(1, b"user") + field_bytes(2, bad))),
            (f"bad utf8 message role {i}", field_bytes(3, field_bytes(1, bad) + field_bytes(2, b"hi"))),
            (f"bad utf8 stop {i}", field_bytes(2, b"hi") + field_bytes(4, field_bytes(5, bad))),
            (f"bad utf8 request_id {i}", field_bytes(2, b"hi") + field_bytes(5, bad)),
        ]
    return out


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random mutation: truncate, flip bits, append junk, double, replace, or overwrite one byte."""
    def overwrite_one(d: bytes) -> bytes:
        i = rng.randrange(max(len(d), 1))
        return d[:i] + bytes([rng.randrange(256)]) + d[i + 1:]

    ops = [
        lambda d: d[: rng.randrange(len(d) + 1)],
        lambda d: bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 0.05 else b for b in d),
        lambda d: d + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))),
        lambda d: d * 2,
        lambda d: bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))),
        overwrite_one,
    ]
    return rng.choice(ops)(data)


def wire_ok(data: bytes) -> bool:
    try:
        pb.GenerateRequest.FromString(data)
        return True
    except DecodeError:
        return False


def test_raw_bytes_invalid_utf8_and_mutations(channel, inference):
    complete = channel.unary_unary(COMPLETE)        # no serializers: bytes in, bytes out
    generate = channel.unary_stream(GENERATE)
    seeds = [valid_request(temperature=0.0).SerializeToString(),
             pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Hi")], request_id="raw-1",
                                sampling=pb.SamplingParams(max_new_tokens=1, stop=["."])).SerializeToString()]
    cases = [(name, data) for name, data in bad_utf8_messages()]
    assert not any(wire_ok(data) for _, data in cases)
    rng = random.Random(1234)
    cases += [(f"mutation {i}", mutate(rng.choice(seeds), rng)) for i in range(300)]
    jobs = [lambda n=n, d=d, f=f: call(f, d, label=n, wire_ok=wire_ok(d))
            for n, d in cases for f in (complete, generate)]
    outcomes = run_all(jobs)
    assert_allowed(outcomes)
    assert all(o.code != grpc.StatusCode.OK for o in outcomes if o.label.startswith("bad utf8"))


# -- the OpenAI HTTP port: only 4xx JSON errors (or a 200), never a 5xx ----------------------------------
HTTP_PATHS = ("/v1/chat/completions", "/v1/completions")
HTTP_AUTH = {"authorization": "Bearer fuzz-key"}
HTTP_TALLY: Counter = Counter()
BODY_LIMIT = 4 * MB       # the gateway's default --max-http-body-bytes
VALUES = [None, 0, -1, 1, 2**31, 2**64, 2**70, -(2**70), 1.5, -0.0, 1e308, "", "x", "\ud800", [], [1], {}, {"a": 1},
          True, False, [{"role": "user"}], [{"role": 1, "content": "x"}], [{"type": "image_url"}]]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "stop", "seed", "n", "stream", "stream_options", "response_format", "user", "ignore_eos",
          "repetition_penalty"]


def http_post(http, path: str, label: str, **kw) -> tuple[str, int]:
    """POST and return (label, status) after checking the reply's shape: a 200 answer or OpenAI's error."""
    reply = http.post(path, **kw)
    HTTP_TALLY[reply.status_code] += 1
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (label, reply.text[:300])
    return label, reply.status_code


def run_http(jobs) -> list[tuple[str, int]]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda job: job(), jobs))


def assert_4xx_or_ok(outcomes: list[tuple[str, int]], expect: int | None = None) -> None:
    bad = [(label, status) for label, status in outcomes if not (status == 200 or 400 <= status < 500)]
    assert bad == [], f"{len(bad)} answers outside 200/4xx, first ones: {bad[:5]}"
    if expect is not None:
        wrong = [(label, status) for label, status in outcomes if status != expect]
        assert wrong == [], wrong[:5]


@pytest.fixture(scope="module")
def http(fuzz_stack):
    import httpx2
    with httpx2.Client(base_url=fuzz_stack.http_url, headers=HTTP_AUTH, timeout=TIMEOUT_S) as client:
        yield client


def nested(depth: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"


def test_http_nesting_bad_utf8_and_odd_content_types_are_400(http):
    bodies = [("100k brackets", b"[" * 100_000 + b"]" * 100_000), ("100k objects", b'{"a":' * 100_000),
              ("deep inside messages", nested(50_000)), ("deep but legal", nested(64)),
              ("bad utf-8", b'{"messages": [{"role": "user", "content": "\xff\xc0"}], "max_tokens": 2}'),
              ("utf-16", '{"prompt": "hi"}'.encode("utf-16")), ("nul bytes", b"\x00" * 1000),
              ("truncated", b'{"messages": [{"role": "user", "content": "hi'), ("empty", b""),
              ("a number", b"12"), ("NaN", b'{"prompt": "hi", "temperature": NaN}')]
    rng = random.Random(7)
    valid = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}'
    bodies += [(f"mutation {i}", bytes(b ^ (rng.random() < 0.05) * rng.randrange(256) for b in valid)) for i in range(60)]
    types = ["application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
             "application/json; charset=latin-1", "", "application/octet-stream"]
    jobs = [lambda p=p, n=n, b=b, t=t: http_post(http, p, f"{n} as {t!r}", content=b, headers={"content-type": t})
            for p in HTTP_PATHS for n, b in bodies for t in types[:3 if n.startswith("mutation") else None]]
    outcomes = run_http(jobs)
    assert_4xx_or_ok(outcomes)
    assert all(status == 400 for label, status in outcomes if label.startswith(("100k", "deep inside", "bad utf")))


def test_http_wrong_types_in_every_field(http):
    base = {"chat": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            "text": {"prompt": "Hi", "max_tokens": 2}}
    jobs = []
    for path, kind in zip(HTTP_PATHS, base):
        for field in FIELDS:
            for value in VALUES:
                body = json.dumps({**base[kind], field: value})  # "\ud800": a lone surrogate escape
                jobs.append(lambda p=path, b=body, f=field, v=value: http_post(http, p, f"{f}={v!r}", content=b))
    outcomes = run_http(jobs)
    assert_4xx_or_ok(outcomes)
    assert sum(status == 400 for _, status in outcomes) > len(outcomes) // 2


def test_http_bodies_over_the_limit_are_413(http):
    def chunks(total: int):
        for _ in range(total // MB):
            yield b" " * MB
    padding = json.dumps({"prompt": "hi", "padding": "x" * (BODY_LIMIT + MB)}).encode()
    outcomes = [http_post(http, "/v1/completions", "declared 5 MiB", content=padding),
                http_post(http, "/v1/completions", "chunked 6 MiB", content=chunks(6 * MB))]
    assert_4xx_or_ok(outcomes, expect=413)


def test_http_port_is_healthy_after_the_fuzz(fuzz_stack, http):
    for path in ("/health", "/ready"):
        assert http.get(path).status_code == 200
    reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
    assert HTTP_TALLY[400] > 0 and HTTP_TALLY[413] > 0 and not any(status >= 500 for status in HTTP_TALLY), HTTP_TALLY
    print(f"\nhttp fuzz outcomes: {dict(HTTP_TALLY.most_common())}")


# -- afterwards: still healthy, still serving --------------------------------------------------------
def test_fuzz_was_meaningful_and_stack_is_healthy(fuzz_stack, inference, auth_metadata):
    total = sum(TALLY.values())
    assert total >= 2000, TALLY
    assert TALLY[grpc.StatusCode.INVALID_ARGUMENT] > 0 and TALLY[grpc.StatusCode.OK] > 0, TALLY
    # A quota that swallows the fuzz would leave validation untested.
    assert TALLY[grpc.StatusCode.RESOURCE_EXHAUSTED] < total // 10, TALLY
    for name, service in fuzz_stack.services.items():
        assert service.alive(), f"{name} died: {service.log_tail()}"
        with grpc.insecure_channel(service.target) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, name
    reply = inference.Complete(pb.GenerateRequest(messages=[pb.ChatMessage(role="user",
                                                                           content="What is the capital of France?")],
                                                  sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=8)),
                               metadata=auth_metadata, timeout=120)
    assert reply.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH) and reply.token_ids
    print(f"\nfuzz outcomes: {dict((c.name, n) for c, n in TALLY.most_common())}")
