"""WorkerService: the gpu_worker process as an `llmserve.runtime.server.Service`.

    start():  load model (thread) ─▶ KV cache from budget ─▶ warm-up forward ─▶ join a queue cell
              ─▶ loop + heartbeat
    drain():  draining=true in the heartbeat ─▶ running sequences finish (≤ drain timeout)
              ─▶ loop stops ─▶ the rest is handed back to the work streams ─▶ HDEL heartbeat
    close():  tasks cancelled, Redis closed

SIGTERM reaches drain() through llmserve.runtime.server.serve; the Drain RPC starts the same drain
and then sets the serve stop event, so the process exits 0 either way.

Its tasks (engine-loop, heartbeat) are supervised (llmserve/runtime/tasks.py): if one ends unexpectedly
(a bug, out of memory, a Redis reply it cannot handle, a step past the watchdog, heartbeats
failing for heartbeat_give_up_s) the worker logs the stack and sets `failure`; serve() turns
health NOT_SERVING, and close() deletes the heartbeat (the batcher then reclaims the inbox at
once) without waiting for a hung step, so the process exits 1 for its supervisor to start a
fresh one. Started before Redis is reachable, it waits for it (redis_wait_s).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog
import torch

from gpu_worker import metrics
from gpu_worker.admin import WorkerAdminServicer
from gpu_worker.config import WorkerSettings
from gpu_worker.engine.constraint import load_constraints
from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams
from gpu_worker.engine.speculation import SpeculationConfig
from gpu_worker.handoff import hand_back
from gpu_worker.heartbeat import Heartbeat
from gpu_worker.model.kv_cache import num_blocks_for_budget
from gpu_worker.model.loader import load_model
from gpu_worker.ops import select_device
from gpu_worker.worker_loop import WorkerLoop
from llmserve.catalog import model_store
from llmserve.protocol import queue_cells
from llmserve.runtime.redis_client import UNAVAILABLE_ERRORS, AnyRedis, connect_when_up
from llmserve.runtime.tasks import TaskSupervisor
from llmserve.v1 import worker_pb2, worker_pb2_grpc

logger = structlog.get_logger(__name__)
_HEARTBEAT_REMOVE_ERRORS: tuple[type[Exception], ...] = (TimeoutError, *UNAVAILABLE_ERRORS)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIN_BLOCKS = 4
REPROBE_CHECKS, REPROBE_IDLE_S = 10, 3.0  # the first half minute: probe again after each idle 3 s


def build_engine(settings: WorkerSettings) -> LLMEngine:
    """Load the model and size the KV cache (blocking; run it in a thread)."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    device = select_device(settings.device)
    model = load_model(settings.model, device, _DTYPES.get(settings.dtype), quantization=settings.quantization)
    dtype = next(model.parameters()).dtype
    budget = settings.kv_cache_mb * 2**20
    num_blocks = settings.num_blocks or num_blocks_for_budget(model.config, settings.block_size, dtype, budget)
    if num_blocks < MIN_BLOCKS:
        raise ValueError(f"kv_cache_mb={settings.kv_cache_mb} gives {num_blocks} blocks; need >= {MIN_BLOCKS}")
    config = EngineConfig(num_blocks=num_blocks, block_size=settings.block_size,
                          max_num_seqs=settings.max_running, max_num_batched_tokens=settings.max_batched_tokens,
                          enable_prefix_caching=settings.prefix_caching,
                          priority_preemption=settings.priority_preemption, aging_steps=settings.aging_steps,
                          fair_tokens=settings.fair_share == "tokens",
                          speculation=SpeculationConfig(settings.draft_tokens(device), settings.spec_max_running,
                                                        max_temperature=settings.spec_max_temperature))
    engine = LLMEngine.create(model, config, constraints=load_constraints(settings.model, model.config.vocab_size))
    logger.info("kv cache ready", num_blocks=num_blocks, block_size=settings.block_size,
                mib=round(engine.kv_cache.nbytes() / 2**20, 1), device=device)
    if settings.bandwidth_probe:
        metrics.PROBE_GBPS.set(engine.probe_bandwidth())
    if device == "cuda" and settings.graph_batch_sizes():
        engine.capture_decode_graphs(settings.graph_batch_sizes())
        reason = engine.decode_graphs.disabled_reason if engine.decode_graphs else "not captured"
        if reason is None:
            logger.info("decode steps captured in CUDA graphs", batch_sizes=settings.graph_batch_sizes())
        else:
            logger.warning("decode steps run eagerly, without CUDA graphs", reason=reason)
    return engine


def warm_up(engine: LLMEngine) -> None:
    """One prefill + one decode so the first request pays no lazy init; leaves no cached state."""
    start = time.monotonic()
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], [SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)])
    engine.reset_stats()
    logger.info("warm-up done", seconds=round(time.monotonic() - start, 2))


class WorkerService:
    """Admin gRPC + engine loop + heartbeat of one worker.

    Args:
        settings: validated settings.
        stop: the event `serve()` waits on; set when a Drain RPC finished draining, or a task died.
    """

    service_names = (worker_pb2.DESCRIPTOR.services_by_name["WorkerAdmin"].full_name,)

    def __init__(self, settings: WorkerSettings, stop: asyncio.Event | None = None) -> None:
        self.settings = settings
        self.stop_event = stop
        self.worker_id = settings.resolved_worker_id()
        self.model_id = model_store.model_id(settings.model)
        self.redis: AnyRedis | None = None
        self.engine: LLMEngine | None = None
        self.loop: WorkerLoop | None = None
        self.heartbeat: Heartbeat | None = None
        self.draining = False
        self.shard = 0                      # the queue cell joined at start (llmserve/protocol/queue_cells.py)
        self.tasks = TaskSupervisor(on_failure=self._fail)
        self._drain_task: asyncio.Task | None = None
        self.failure: BaseException | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerAdminServicer_to_server(WorkerAdminServicer(self), server)

    async def start(self) -> None:
        redis = self.redis = await connect_when_up(self.settings.redis_url, self.settings.redis_password,
                                                   wait_s=self.settings.redis_wait_s, socket_timeout=5.0)
        logger.info("loading model", model=self.settings.model, worker_id=self.worker_id)
        engine = self.engine = await asyncio.to_thread(build_engine, self.settings)
        if self.settings.warmup:
            await asyncio.to_thread(warm_up, engine)
        self.shard = await queue_cells.join(redis, self.model_id, self.settings.queue_shards)
        loop = self.loop = WorkerLoop(engine, redis, self.model_id, self.worker_id,
                                      self.settings.events_ttl_s, self.settings.max_inbox_batches, self.shard,
                                      step_timeout_s=self.settings.step_timeout_s)
        heartbeat = self.heartbeat = Heartbeat(
            redis, self.model_id, self.worker_id, self.settings.admin_address(),
            self.settings.heartbeat_s, self.settings.block_size, self.settings.max_running,
            snapshot=lambda: loop.snapshot, draining=lambda: self.draining, shard=self.shard,
            give_up_s=self.settings.heartbeat_give_up_s, architecture=engine.model.config.architecture,
            weight_format=engine.model.weight_format)
        self.tasks.start("engine-loop", loop.run())
        self.tasks.start("heartbeat", heartbeat.run())
        if self.settings.bandwidth_probe:
            self.tasks.start("bandwidth-probe", self._probe_while_idle(loop, engine), may_return=True)
        logger.info("worker ready", worker_id=self.worker_id, model=self.model_id, queue_shard=self.shard,
                    step_thread=loop.step_thread.native_id)

    async def _probe_while_idle(self, loop: WorkerLoop, engine: LLMEngine) -> None:
        """Probe the bandwidth again whenever the worker idled REPROBE_IDLE_S, the best kept: the probe at
        start can land among the other services' start-up on a small machine (gpu_worker/roofline.py)."""
        for _ in range(REPROBE_CHECKS):
            steps = loop.snapshot.steps
            await asyncio.sleep(REPROBE_IDLE_S)
            if loop.snapshot.steps == steps and not loop.busy:
                metrics.PROBE_GBPS.set(await asyncio.to_thread(engine.probe_bandwidth))

    def _fail(self, exc: BaseException) -> None:
        """A task died (logged by the supervisor): serve() goes NOT_SERVING and exits 1 after close()."""
        self.failure = exc
        if self.stop_event is not None:
            self.stop_event.set()

    # --- drain -------------------------------------------------------------------------------
    def request_drain(self, timeout_s: float | None) -> None:
        """Drain in the background (Drain RPC); the serve loop stops when it is done."""
        task = self._ensure_drain(timeout_s)
        stop = self.stop_event
        if stop is not None:
            task.add_done_callback(lambda _t: stop.set())

    async def drain(self) -> None:
        await asyncio.shield(self._ensure_drain(None))

    def _ensure_drain(self, timeout_s: float | None) -> asyncio.Task:
        if self._drain_task is None:
            timeout = self.settings.drain_timeout_s if timeout_s is None else timeout_s
            self._drain_task = asyncio.create_task(self._drain(timeout), name="drain")
        return self._drain_task

    async def _drain(self, timeout_s: float) -> None:
        self.draining = True
        loop, heartbeat, redis = self.loop, self.heartbeat, self.redis
        if loop is None or heartbeat is None or redis is None:           # stopped before it ever started
            return
        logger.info("draining", timeout_s=timeout_s, running=loop.snapshot.running)
        loop.accepting = False
        try:
            await heartbeat.beat()
        except UNAVAILABLE_ERRORS as exc:
            logger.warning("could not announce the drain", error=repr(exc))
        deadline = time.monotonic() + timeout_s
        while loop.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.tasks.stopping = True
        loop.stop()
        if "engine-loop" in self.tasks:         # not when it died before the drain (then close() follows)
            await self.tasks["engine-loop"]
        await self._hand_back_rest(loop, redis)
        await self.tasks.cancel("heartbeat")     # no heartbeat write may land after the HDEL
        await _remove_heartbeat(heartbeat)
        logger.info("drained")

    async def _hand_back_rest(self, loop: WorkerLoop, redis: AnyRedis) -> None:
        for attempt in range(20):
            try:
                await loop.flush()
                unread = await loop.read_unread_inbox()
                items, entries = loop.items_to_hand_back(unread)
                await hand_back(redis, self.model_id, self.worker_id, items, entries, self.shard)
                metrics.HANDED_BACK.inc(len(items))
                logger.info("handed back", items=len(items), entries=len(entries),
                            request_ids=[i.request_id for i in items])
                return
            except UNAVAILABLE_ERRORS as exc:
                logger.warning("handoff failed; retrying", attempt=attempt, error=repr(exc))
                await asyncio.sleep(0.5)
        logger.error("handoff gave up; the batcher will reclaim the inbox entries")

    # --- stats / close -----------------------------------------------------------------------
    def stats(self) -> worker_pb2.WorkerStats:
        s = self.loop.snapshot if self.loop else None
        out = worker_pb2.WorkerStats(worker_id=self.worker_id, model=self.model_id, draining=self.draining,
                                     block_size=self.settings.block_size)
        if s:
            out.running, out.waiting, out.free_blocks, out.total_blocks = s.running, s.waiting, s.free_blocks, \
                s.total_blocks
            out.generated_tokens, out.preemptions, out.prefix_cache_hit_rate = s.generated_tokens, s.preemptions, \
                s.prefix_hit_rate
        return out

    async def close(self) -> None:
        """Stop the tasks; after a failure also delete the heartbeat, and leave a hung step behind."""
        await self.tasks.cancel_all()
        if self.failure is not None and self.heartbeat is not None:
            await _remove_heartbeat(self.heartbeat)
        if self.loop:
            self.loop.close(wait=self.failure is None)
        if self.redis is not None:
            await self.redis.aclose()


async def _remove_heartbeat(heartbeat: Heartbeat) -> None:
    try:
        async with asyncio.timeout(5.0):
            await heartbeat.remove()
    except _HEARTBEAT_REMOVE_ERRORS as exc:
        logger.warning("could not delete the heartbeat; it expires by itself", error=repr(exc))

