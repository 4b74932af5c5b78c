"""The worker's engine loop in this process, on a tiny random Llama and a real Valkey: every busy
turn writes the last step's events and takes new inbox entries, entries whose read reply was
lost are read again without running twice, and a grammar waiting for its vocabulary keeps the
event loop free."""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import Future

import pytest
import redis
import torch

from gpu_worker.engine.constraint import Constraints
from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.requests import sampling_params
from gpu_worker.worker_loop import WorkerLoop
from llmserve.protocol import keys, queue
from llmserve.runtime import redis_client
from llmserve.v1 import inference_pb2, queue_pb2
from tokenizer_svc.loader import load_tokenizer

VOCAB, MODEL, WORKER, TENANT = 128, "tiny", "w-loop", "t1"


def make_engine(vocab_size: int = VOCAB, constraints: Constraints | None = None) -> LLMEngine:
    config = ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, context_length=256, tie_word_embeddings=True)
    model = LlamaModel(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data.copy_(torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.2)
    return LLMEngine.create(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8), constraints=constraints)


def item(request_id: str, max_new: int) -> queue_pb2.WorkItem:
    return queue_pb2.WorkItem(
        request_id=request_id, tenant=TENANT, model=MODEL, prompt_token_ids=[(3 * len(request_id) + k) % VOCAB
                                                                             for k in range(9)],
        sampling=queue_pb2.ResolvedSampling(temperature=0.0, top_p=1.0, max_new_tokens=max_new, repetition_penalty=1.0),
        priority=inference_pb2.PRIORITY_NORMAL, events_key=keys.events_stream(TENANT, request_id),
        cancel_key=keys.cancel_key(TENANT, request_id))


def dispatch(client: redis.Redis, batch_id: str, items: list[queue_pb2.WorkItem]) -> None:
    batch = queue_pb2.Batch(batch_id=batch_id, items=items, created_unix_ms=int(time.time() * 1000))
    client.xadd(keys.inbox_stream(MODEL, WORKER), queue.batch_entry(batch))


def tokens(client: redis.Redis, it: queue_pb2.WorkItem) -> tuple[list[int], int]:
    """(the completion, how many final events) from the request's event stream; asserts no gap."""
    out: list[int] = []
    finals = 0
    for _, fields in client.xrange(it.events_key):
        event = queue.decode_event(fields)
        assert event.index == len(out), (event.index, len(out))
        out += list(event.token_ids)
        finals += event.final
    return out, finals


@pytest.fixture
async def loop(redis_url, clean_redis):
    client = redis_client.connect(redis_url)
    worker_loop = WorkerLoop(make_engine(), client, MODEL, WORKER, events_ttl_s=60, max_inbox_batches=4)
    await worker_loop.inbox.ensure_group()
    yield worker_loop
    worker_loop.close()
    await client.aclose()


async def run_until_idle(worker_loop: WorkerLoop, turns: int = 200) -> None:
    for _ in range(turns):
        await worker_loop._turn()
        if not worker_loop.busy:
            return
    raise AssertionError("the loop did not finish its work")


async def test_each_busy_turn_publishes_the_last_step_and_reads_the_inbox(loop, clean_redis):
    one, two = item("one", 12), item("two", 4)
    dispatch(clean_redis, "b1", [one])
    await loop._turn()                             # idle: the blocking read, then the prefill step
    dispatch(clean_redis, "b2", [two])
    await loop._turn()                             # busy: the prefill's token out and b2 in, one pipeline
    assert clean_redis.xlen(one.events_key) == 1 and len(loop.state.tracked) == 2
    for turn in range(3):
        await loop._turn()
        assert clean_redis.xlen(one.events_key) == 2 + turn   # each step's event, written by the next turn
    await run_until_idle(loop)
    for it in (one, two):                          # the same tokens as each alone
        alone = make_engine().generate([list(it.prompt_token_ids)], [sampling_params(it)])[0]
        assert tokens(clean_redis, it) == (alone, 1), it.request_id


async def test_entries_read_again_after_a_lost_reply_do_not_run_twice(loop, clean_redis):
    first, second = item("first", 10), item("second", 6)
    dispatch(clean_redis, "b1", [first])
    await loop._turn()
    dispatch(clean_redis, "b2", [second])
    await loop._turn()                             # the pipelined read takes b2
    assert len(loop.state.tracked) == 2
    loop.inbox.reread_pending()                    # as after a pipeline whose reply was lost
    await run_until_idle(loop)
    for it in (first, second):
        out, finals = tokens(clean_redis, it)
        assert len(out) == it.sampling.max_new_tokens and finals == 1, it.request_id
    assert clean_redis.xpending(keys.inbox_stream(MODEL, WORKER), keys.INBOX_GROUP)["pending"] == 0


@pytest.mark.timeout(120)   # a loop blocked on the load hangs here: fail in bounded time
async def test_a_grammar_waiting_for_its_vocabulary_leaves_the_event_loop_free(redis_url, clean_redis, smollm2_path):
    vocab = load_tokenizer(smollm2_path)
    loading: Future = Future()                     # the vocabulary load the worker starts in the background
    client = redis_client.connect(redis_url)
    worker_loop = WorkerLoop(make_engine(vocab.vocab_size, Constraints(loading, vocab.vocab_size)), client, MODEL,
                             WORKER, events_ttl_s=60, max_inbox_batches=4)
    try:
        await worker_loop.inbox.ensure_group()
        it = item("digits", 8)
        it.sampling.response_format.regex = "[0-9]{3}"
        it.sampling.stop_token_ids.extend(vocab.eos_token_ids)
        dispatch(clean_redis, "b1", [it])
        turn = asyncio.create_task(worker_loop._turn())
        for _ in range(20):                        # a loop blocked on the load would never get here
            await asyncio.sleep(0.01)
        assert not turn.done()
        loading.set_result(Constraints.from_tokenizer_json(vocab.to_json(), vocab.eos_token_ids,
                                                           vocab.vocab_size).tokenizer)
        await turn
        await run_until_idle(worker_loop)
        out, finals = tokens(clean_redis, it)
        assert finals == 1 and re.fullmatch("[0-9]{3}", vocab.decode(out)), vocab.decode(out)
    finally:
        worker_loop.close()
        await client.aclose()
