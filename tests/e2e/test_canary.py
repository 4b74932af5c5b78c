"""Model versions, a weighted canary and the one-command rollback, on one real stack started
from a models file: the same SmolLM2 GGUF served as smollm2-135m@v1 and @v2 (one CPU worker
each), the alias smollm2-135m at 95/5, two gateways.

Which version served a request is read from its x-served-model header; request ids whose
weighted pick is known (llmserve.protocol.seeded_pick.weighted_pick) make the routing tests deterministic.
The drain test stops every v2 worker, so it runs last."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from gateway.tenants import hash_key
from llmserve.catalog import routes
from llmserve.protocol import keys
from llmserve.protocol.seeded_pick import weighted_pick
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc, queue_pb2

pytestmark = pytest.mark.e2e

ALIAS, V1, V2 = "smollm2-135m", "smollm2-135m@v1", "smollm2-135m@v2"
SEED = {V1: 95, V2: 5}
DEV = (("authorization", "Bearer dev-key"),)
V1_ONLY = (("authorization", "Bearer v1-only-key"),)
TINY = pb.SamplingParams(temperature=0.0, max_new_tokens=1)
LONG = pb.SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
MODELS_FILE = f"""
models:
  - {{id: {V1}, path: smollm2-135m, workers: 1}}
  - {{id: {V2}, path: smollm2-135m, workers: 1}}
aliases:
  {ALIAS}: {{{V1}: 95, {V2}: 5}}
default: {ALIAS}
"""


def _tenant(tenant_id: str, key: str, models: list[str]) -> dict:
    return {"id": tenant_id, "api_keys": [f"sha256:{hash_key(key)}"], "requests_per_second": 500, "burst": 1000,
            "tokens_per_minute": 10_000_000, "max_concurrent": 64, "max_new_tokens": 256, "models": models}


@pytest.fixture(scope="module")
def canary(tmp_path_factory):
    """The one stack of this module: two versions, two gateways, a short max queue wait."""
    from llmserve.local.stack import Stack, StackConfig

    tmp = tmp_path_factory.mktemp("canary")
    (tmp / "models.yaml").write_text(MODELS_FILE)
    tenants = {"tenants": [_tenant("dev", "dev-key", ["*"]), _tenant("v1-only", "v1-only-key", [V1])]}
    (tmp / "tenants.yaml").write_text(json.dumps(tenants))
    config = StackConfig(models_file=tmp / "models.yaml", gateways=2, device="cpu", port=0, http_port=-1,
                         tenants=tmp / "tenants.yaml", log_dir=tmp / "logs",
                         extra_flags={"gateway": ["--max-queue-wait-s", "4"],
                                      "gpu_worker": ["--torch-threads", "1", "--kv-cache-mb", "64"]})
    stack = Stack(config).start()
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def stubs(canary):
    channels = [grpc.insecure_channel(target) for target in canary.gateway_targets]
    yield [inference_pb2_grpc.InferenceStub(c) for c in channels]
    for channel in channels:
        channel.close()


@pytest.fixture(scope="module")
def valkey_client(canary):
    client = redis.Redis.from_url(canary.redis_url)
    yield client
    client.close()


def route_cli(canary, *args: str) -> str:
    """`llmserve route …` as an operator runs it."""
    done = subprocess.run([sys.executable, "-m", "llmserve.cli", "route", ALIAS, *args, "--redis-url",
                           canary.redis_url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def ids_routed_to(model: str, count: int, weights=SEED) -> list[str]:
    """Request ids the alias's weighted pick sends to `model` under `weights`."""
    out = []
    while len(out) < count:
        rid = "canary-" + uuid.uuid4().hex[:12]
        if weighted_pick(weights, rid, ALIAS) == model:
            out.append(rid)
    return out


def served(stub, rid: str, metadata=DEV, model: str = ALIAS, sampling=TINY) -> str:
    """Complete one request; the x-served-model it came back with."""
    _, call = stub.Complete.with_call(pb.GenerateRequest(model=model, prompt="Hi", sampling=sampling, request_id=rid),
                                      metadata=metadata, timeout=120)
    return dict(call.initial_metadata())["x-served-model"]


def error_of(stub, metadata, model: str = ALIAS) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        served(stub, "canary-" + uuid.uuid4().hex[:12], metadata, model)
    return err.value


def binomial_band(n: int, p: float, mass: float = 0.999) -> tuple[int, int]:
    """Smallest k_lo and k_hi with P(X < k_lo) and P(X > k_hi) each at most (1 - mass) / 2."""
    pmf = [math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)]
    tail, lo = 0.0, 0
    while tail + pmf[lo] <= (1 - mass) / 2:
        tail += pmf[lo]
        lo += 1
    tail, hi = 0.0, n
    while tail + pmf[hi] <= (1 - mass) / 2:
        tail += pmf[hi]
        hi -= 1
    return lo, hi


def test_alias_splits_95_5_within_the_binomial_band(canary, stubs):
    n = 400
    with ThreadPoolExecutor(16) as pool:
        models = list(pool.map(lambda i: served(stubs[i % 2], f"split-{uuid.uuid4().hex}"), range(n)))
    on_v2 = models.count(V2)
    lo, hi = binomial_band(n, 0.05)
    print(f"\n95/5 canary: {on_v2} of {n} requests on v2 ({100 * on_v2 / n:.1f} %), 99.9 % band [{lo}, {hi}]")
    assert set(models) <= {V1, V2}
    assert lo <= on_v2 <= hi
    for service, model in (("gateway-0", None), (canary.workers_of(V2)[0].name, V2)):
        log = (canary.log_dir / f"{service}.log").read_text()
        lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        assert lines and all("version" in line for line in lines)    # every line: the service's version ...
        assert model is None or (all("model" in line for line in lines) and    # ... and the concrete id
                                 any(line["model"] == model for line in lines))


def test_pin_header_overrides_the_weights(canary, stubs):
    rid_v1 = ids_routed_to(V1, 3)
    assert {served(stubs[0], rid, DEV + (("x-model-version", "v2"),)) for rid in rid_v1} == {V2}
    assert served(stubs[1], ids_routed_to(V2, 1)[0], DEV + (("x-model-version", "v1"),)) == V1
    assert served(stubs[0], "canary-" + uuid.uuid4().hex, model=V2) == V2          # a concrete id
    missing = error_of(stubs[0], DEV + (("x-model-version", "v9"),))
    assert missing.code() == grpc.StatusCode.NOT_FOUND and "v9" in missing.details()
    unknown = error_of(stubs[0], DEV, model="smollm2-9b")
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and "smollm2-9b" in unknown.details()


def test_openai_http_answers_with_x_served_model(canary):
    body = json.dumps({"model": ALIAS, "prompt": "Hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{canary.http_url}/v1/completions", body, method="POST", headers={
        "authorization": "Bearer dev-key", "content-type": "application/json", "x-model-version": "v2"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers["x-served-model"] == V2
        assert json.loads(reply.read())["model"] == V2


def test_list_models_lists_versions_and_the_alias_with_weights(stubs):
    infos = {m.id: m for m in stubs[0].ListModels(pb.ListModelsRequest(), metadata=DEV, timeout=10).models}
    assert infos[V1].kind == infos[V2].kind == pb.MODEL_KIND_CONCRETE
    alias = infos[ALIAS]
    assert alias.kind == pb.MODEL_KIND_ALIAS and alias.is_default and alias.context_length > 0
    assert {r.model: r.weight for r in alias.routes} == SEED


def test_tenant_allowed_only_v1_is_refused_v2(stubs):
    assert served(stubs[0], "canary-" + uuid.uuid4().hex, V1_ONLY, model=V1) == V1
    for metadata, model in ((V1_ONLY + (("x-model-version", "v2"),), V1), (V1_ONLY, V2)):
        refused = error_of(stubs[0], metadata, model)
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED and V2 in refused.details()


def alias_weights(stub) -> dict[str, int]:
    infos = stub.ListModels(pb.ListModelsRequest(), metadata=DEV, timeout=10).models
    return next({r.model: r.weight for r in m.routes} for m in infos if m.id == ALIAS)


def test_route_rollback_reaches_every_gateway_while_running_streams_finish(canary, stubs):
    streams = []
    for i, rid in enumerate(ids_routed_to(V2, 2)):
        call = stubs[i % 2].Generate(pb.GenerateRequest(prompt="Once upon a time", sampling=LONG, request_id=rid),
                                     metadata=DEV, timeout=300)
        assert dict(call.initial_metadata())["x-served-model"] == V2
        streams.append((call, [next(call)]))
    out = route_cli(canary, f"{V1}=100")   # the weights are in Redis once the command returns
    started = time.monotonic()
    assert f"{V1}=100" in out
    pending = set(range(len(stubs)))
    seen_after = {}
    while pending and time.monotonic() - started < 5.0:
        for i in list(pending):
            if alias_weights(stubs[i]) == {V1: 100}:
                seen_after[i] = time.monotonic() - started
                pending.discard(i)
        time.sleep(0.02)
    print("\nroute propagation after `llmserve route` returned: " +
          ", ".join(f"gateway-{i} {t * 1000:.0f} ms" for i, t in sorted(seen_after.items())))
    assert not pending, "a gateway did not see the new weights within 5 s"   # (refresh: every 250 ms)
    old_v2_ids = ids_routed_to(V2, 4)       # went to v2 before the rollback: now v1, on every gateway
    assert {served(stubs[i % 2], rid) for i, rid in enumerate(old_v2_ids)} == {V1}
    for call, chunks in streams:            # ... while the streams that were running stay on v2 to the end
        chunks += list(call)
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in chunks) == LONG.max_new_tokens
    assert routes.decode_weights(redis.Redis.from_url(canary.redis_url).get(routes.alias_key(ALIAS))) == {V1: 100}
    assert "smollm2-135m@v1=100" in route_cli(canary)               # `route ALIAS` prints the split
    route_cli(canary, f"{V1}=95", f"{V2}=5")


def test_route_rejects_bad_weights(canary):
    for args in ((f"{V1}=0",), ("nope@v1=5",), (f"{V1}=-1",), (f"{V1}=x",)):
        done = subprocess.run([sys.executable, "-m", "llmserve.cli", "route", ALIAS, *args, "--redis-url",
                               canary.redis_url], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and done.stderr, args


def test_resume_after_gateway_kill_stays_on_its_version(canary, stubs):
    doomed = canary.start_gateway()
    doomed.wait_serving(time.monotonic() + 120)
    rid = ids_routed_to(V2, 1)[0]
    request = pb.GenerateRequest(prompt="Once upon a time", sampling=LONG, request_id=rid)
    with grpc.insecure_channel(doomed.target) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(request, metadata=DEV, timeout=300)
        assert dict(call.initial_metadata())["x-served-model"] == V2
        before = [next(call) for _ in range(3)]
        canary.kill(doomed.name)
        with pytest.raises(grpc.RpcError):
            list(call)
    route_cli(canary, f"{V1}=100")          # new traffic moves; the resumed request must not
    try:
        next_index = before[-1].index + len(before[-1].token_ids)
        resumed = stubs[0].Generate(request, metadata=DEV + (("x-resume-from", str(next_index)),), timeout=300)
        assert dict(resumed.initial_metadata())["x-served-model"] == V2
        after = list(resumed)
        assert after[0].index == next_index and after[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        route_cli(canary, f"{V1}=95", f"{V2}=5")


def live_workers(client, model: str) -> int:
    beats = [queue_pb2.WorkerHeartbeat.FromString(v) for v in client.hgetall(keys.workers_hash(model)).values()]
    return sum(1 for b in beats if not b.draining)


def test_drained_v2_sends_the_alias_to_v1_and_a_v2_pin_gets_unavailable(canary, stubs, valkey_client):
    for worker in canary.workers_of(V2):    # last test: the v2 workers do not come back
        assert worker.stop(60) == 0
    assert live_workers(valkey_client, V2) == 0
    time.sleep(0.6)                         # two route refreshes of every gateway
    assert {served(stubs[i % 2], rid) for i, rid in enumerate(ids_routed_to(V2, 4))} == {V1}
    pinned = error_of(stubs[0], DEV + (("x-model-version", "v2"),))   # waits its max queue wait (4 s)
    assert pinned.code() == grpc.StatusCode.UNAVAILABLE and "no worker took the request" in pinned.details()
