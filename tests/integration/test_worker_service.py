"""The real worker process (`python -m gpu_worker`) against a real Valkey, on a tiny random
Llama written by the test as a Hugging Face directory: the test plays gateway and batcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch
from safetensors.torch import save_file

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.model.loader import load_model
from gpu_worker.requests import sampling_params
from llmserve.protocol import keys, queue
from llmserve.v1 import inference_pb2, queue_pb2, worker_pb2, worker_pb2_grpc

VOCAB, LAYERS, HIDDEN, INTER, HEADS, KV_HEADS = 256, 2, 64, 128, 4, 2
TENANT = "t1"
REPO = Path(__file__).resolve().parents[2]


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN // HEADS

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(HIDDEN), p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(INTER, HIDDEN), p + "mlp.up_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTER),
        }
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


MODEL = "tiny-llama"


class Worker:
    """A `python -m gpu_worker` child process."""

    def __init__(self, redis_url: str, model_dir: Path, worker_id: str, *extra: str) -> None:
        self.worker_id = worker_id
        cmd = [sys.executable, "-m", "gpu_worker", "--redis-url", redis_url, "--model", str(model_dir),
               "--device", "cpu", "--dtype", "float32", "--worker-id", worker_id, "--heartbeat-s", "0.2",
               "--num-blocks", "256", "--log-level", "warning", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)

    def heartbeat(self, client: redis.Redis) -> queue_pb2.WorkerHeartbeat | None:
        raw = client.hget(keys.workers_hash(MODEL), self.worker_id)
        return queue_pb2.WorkerHeartbeat.FromString(raw) if raw else None

    def wait_ready(self, client: redis.Redis, timeout: float = 180) -> queue_pb2.WorkerHeartbeat:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"worker exited: {self.proc.stderr.read()}"
            if hb := self.heartbeat(client):
                return hb
            time.sleep(0.1)
        raise TimeoutError("worker never heartbeated")

    def wait_exit(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def workers(redis_url, clean_redis):
    started: list[Worker] = []
    yield lambda *a, **kw: started.append(Worker(redis_url, *a, **kw)) or started[-1]
    for w in started:
        w.kill()


def make_item(request_id: str, prompt: list[int], max_new: int, temperature: float = 0.0, seed: int = 0,
              deadline_ms: int = 0) -> queue_pb2.WorkItem:
    return queue_pb2.WorkItem(
        request_id=request_id, tenant=TENANT, model=MODEL, prompt_token_ids=prompt,
        sampling=queue_pb2.ResolvedSampling(temperature=temperature, top_p=0.9, top_k=40, max_new_tokens=max_new,
                                            seed=seed, repetition_penalty=1.0),
        priority=inference_pb2.PRIORITY_NORMAL, deadline_unix_ms=deadline_ms,
        events_key=keys.events_stream(TENANT, request_id), cancel_key=keys.cancel_key(TENANT, request_id))


def dispatch(client: redis.Redis, worker_id: str, items: list[queue_pb2.WorkItem], batch_id: str = "b1") -> None:
    inbox = keys.inbox_stream(MODEL, worker_id)
    batch = queue_pb2.Batch(batch_id=batch_id, items=items, created_unix_ms=int(time.time() * 1000))
    client.xadd(inbox, queue.batch_entry(batch))


def events(client: redis.Redis, item: queue_pb2.WorkItem) -> list[queue_pb2.TokenEvent]:
    return [queue.decode_event(f) for _, f in client.xrange(item.events_key)]


def wait_final(client: redis.Redis, items: list[queue_pb2.WorkItem], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(any(e.final for e in events(client, i)) for i in items):
            return
        time.sleep(0.05)
    raise TimeoutError("no final event")


def completion(evs: list[queue_pb2.TokenEvent]) -> list[int]:
    """Tokens by index, asserting there is no gap; duplicates (same index, same tokens) are dropped."""
    out: list[int] = []
    for e in evs:
        assert e.index <= len(out), f"gap at {len(out)}: event index {e.index}"
        out[e.index:e.index + len(e.token_ids)] = list(e.token_ids)
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model in this process: what an undisturbed run generates."""
    engine = LLMEngine.create(load_model(str(model_dir), "cpu", torch.float32, quantization="auto"),  # the worker default
                              EngineConfig(num_blocks=256))

    def run(items: list[queue_pb2.WorkItem]) -> list[list[int]]:
        return engine.generate([list(i.prompt_token_ids) for i in items], [sampling_params(i) for i in items])
    return run


def prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * k) % VOCAB for k in range(n)]


def test_batch_runs_to_final_events_and_acks(workers, model_dir, clean_redis, reference):
    worker = workers(model_dir, "w1")
    hb = worker.wait_ready(clean_redis)
    assert (hb.total_blocks, hb.block_size, hb.max_running, hb.draining) == (256, 16, 32, False)
    items = [make_item("r1", prompt(20, 1), 10), make_item("r2", prompt(33, 2), 7, temperature=0.8, seed=5),
             make_item("r3", prompt(5, 3), 12)]
    dispatch(clean_redis, "w1", items)
    wait_final(clean_redis, items)
    expected = reference(items)
    for item, want in zip(items, expected):
        evs = events(clean_redis, item)
        assert completion(evs) == want
        assert [e.index for e in evs] == list(range(len(want) + 1))[:len(evs)]
        assert evs[0].prompt_tokens == len(item.prompt_token_ids) and evs[0].admitted_unix_ms > 0
        assert evs[-1].final and evs[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert {e.worker_id for e in evs} == {"w1"}
        assert clean_redis.ttl(item.events_key) > 0
    inbox = keys.inbox_stream(MODEL, "w1")
    deadline = time.monotonic() + 30
    while clean_redis.xpending(inbox, keys.INBOX_GROUP)["pending"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert clean_redis.xpending(inbox, keys.INBOX_GROUP)["pending"] == 0
    # a second request sharing the first one's prompt hits the prefix cache
    again = make_item("r4", prompt(20, 1), 10)
    dispatch(clean_redis, "w1", [again], "b2")
    wait_final(clean_redis, [again])
    evs = events(clean_redis, again)
    assert evs[0].cached_prompt_tokens == 16
    assert completion(evs) == expected[0]


def test_cancel_deadline_invalid_then_drain_rpc(workers, model_dir, clean_redis):
    worker = workers(model_dir, "w2")
    hb = worker.wait_ready(clean_redis)
    long = make_item("long", prompt(10, 4), 900)
    late = make_item("late", prompt(10, 5), 5, deadline_ms=int(time.time() * 1000) - 1)
    bad = make_item("bad", [VOCAB + 5], 5)
    dispatch(clean_redis, "w2", [long, late, bad])
    deadline = time.monotonic() + 60
    while not events(clean_redis, long) and time.monotonic() < deadline:
        time.sleep(0.02)
    clean_redis.set(long.cancel_key, 1)
    wait_final(clean_redis, [long, late, bad])
    last = events(clean_redis, long)[-1]
    assert last.final and last.finish_reason == inference_pb2.FINISH_REASON_CANCELLED
    assert len(completion(events(clean_redis, long))) < 900
    assert events(clean_redis, late)[-1].error.code == "DEADLINE_EXCEEDED"
    assert events(clean_redis, bad)[-1].error.code == "INVALID_ARGUMENT"
    with grpc.insecure_channel(hb.admin_address) as channel:
        stub = worker_pb2_grpc.WorkerAdminStub(channel)
        stats = stub.Stats(worker_pb2.StatsRequest(), timeout=10)
        assert (stats.worker_id, stats.total_blocks, stats.running) == ("w2", 256, 0)
        assert stub.Drain(worker_pb2.DrainRequest(), timeout=10).draining
    assert worker.wait_exit() == 0
    assert worker.heartbeat(clean_redis) is None


def test_sigterm_drain_hands_back_and_other_worker_continues(workers, model_dir, clean_redis, reference):
    a = workers(model_dir, "wa", "--drain-timeout-s", "0")
    b = workers(model_dir, "wb")
    a.wait_ready(clean_redis)
    b.wait_ready(clean_redis)
    items = [make_item(f"h{i}", prompt(12 + 5 * i, 10 + i), 300, temperature=0.0 if i % 2 else 0.9, seed=40 + i)
             for i in range(4)]
    dispatch(clean_redis, "wa", items)
    deadline = time.monotonic() + 60
    while not all(len(events(clean_redis, i)) >= 3 for i in items) and time.monotonic() < deadline:
        time.sleep(0.01)
    a.proc.send_signal(signal.SIGTERM)
    assert a.wait_exit() == 0
    assert a.heartbeat(clean_redis) is None
    stream = keys.work_stream(MODEL, inference_pb2.PRIORITY_NORMAL)
    handed = [queue.decode_item(f) for _, f in clean_redis.xrange(stream)]
    assert sorted(i.request_id for i in handed) == ["h0", "h1", "h2", "h3"]
    for item in handed:                                 # tokens so far travel with the item
        produced = completion(events(clean_redis, item))
        assert list(item.generated_token_ids) == produced and len(produced) >= 3
    assert clean_redis.xpending(keys.inbox_stream(MODEL, "wa"), keys.INBOX_GROUP)["pending"] == 0
    dispatch(clean_redis, "wb", handed, "b-handoff")   # the batcher's job
    wait_final(clean_redis, items)
    for item, want in zip(items, reference(items)):
        evs = events(clean_redis, item)
        assert completion(evs) == want
        assert [e.index for e in evs] == list(range(len(evs)))   # one token per event, no gap, no repeat
        assert {e.worker_id for e in evs} == {"wa", "wb"}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_worker_setting_quantization_reaches_the_model(model_dir, quantization):
    from gpu_worker.config import WorkerSettings
    from gpu_worker.ops.weights.quantized_linear import quantize
    from gpu_worker.service import build_engine

    settings = WorkerSettings.load(["--model", str(model_dir), "--device", "cpu", "--quantization", quantization,
                                    "--num-blocks", "16"], env={})
    layer = build_engine(settings).model.layers[0]
    assert type(layer.qkv_weight) is type(quantize(torch.zeros(8, 64), quantization))
