"""The worker's engine loop: inbox → engine → token events, one engine step per turn.

    ┌─ idle (or on start): read the inbox, blocking (own pending entries first)
    │  engine.step() in a thread        ║  one pipeline, meanwhile: events of the last step,
    │  (the event loop stays free for   ║  cancel keys, new inbox entries (no wait), acks of
    │   gRPC, heartbeats and Redis)     ║  finished batches; their grammars compiled (a thread)
    └─ both done: the step's tokens become events; then engine.abort + final events, engine.add

A busy turn is one Redis round trip, and it runs while the step computes: between two steps
the round trip would cost a noticeable share of one sequence's token rate (docs/performance.md).
What the replies ask of the engine (cancels, fenced requests, new batches) is applied once the
step is done, so it takes effect a step later than it arrived.

Only this loop touches the engine, so add/abort/step never race (`engine.prepare`, which
compiles a new request's grammar off the event loop, touches only the request). After a step
the loop keeps the engine's `stats()` for heartbeats and Stats, which run concurrently.

A step that runs past `step_timeout_s` ends the loop with `StepTimeout` (the step cannot be
interrupted; its thread is left behind): the worker fails and its supervisor replaces it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from gpu_worker import metrics
from gpu_worker.engine.engine import EngineStats, LLMEngine, StepOutput
from gpu_worker.engine.sequence import FINISH_CANCELLED, Failure
from gpu_worker.events import Emission, EventPublisher
from gpu_worker.inbox import Inbox, InboxEntry
from gpu_worker.request_spans import RequestSpans
from gpu_worker.requests import Tracked, handoff_items, validate_item
from gpu_worker.step_thread import StepThread
from llmserve.runtime import redis_client, tracing
from llmserve.runtime.clock import now_ms
from llmserve.runtime.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from llmserve.runtime.redis_client import UNAVAILABLE_ERRORS
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)
IDLE_BLOCK_MS = 200
ADVERTISED_PREFIX_HASHES = 64  # in each heartbeat: about 8 hot prefixes of 8 blocks


class StepTimeout(RuntimeError):
    """An engine step ran past the watchdog's limit."""


@dataclass(frozen=True)
class Arrival:
    """A new inbox entry's requests, each with why it cannot run ("" when it can)."""

    entry: InboxEntry
    requests: list[tuple[Tracked, str]]


@dataclass
class LoopState:
    tracked: dict[int, Tracked] = field(default_factory=dict)      # seq_id -> request
    entries: dict[str, set[int]] = field(default_factory=dict)     # inbox entry -> seq ids still open
    unpublished: list[Emission] = field(default_factory=list)
    unacked: list[str] = field(default_factory=list)


class WorkerLoop:
    """Runs the engine against this worker's inbox until stopped.

    Args:
        engine: the engine (owned by this loop from now on).
        redis: client (socket timeout above IDLE_BLOCK_MS).
        model: model id; worker_id: this worker; events_ttl_s: TTL of event streams.
        max_inbox_batches: inbox entries per read. shard: the queue cell the worker joined.
        step_timeout_s: the step watchdog's limit.
    """

    def __init__(self, engine: LLMEngine, redis: redis_client.AnyRedis, model: str, worker_id: str,
                 events_ttl_s: int, max_inbox_batches: int, shard: int = 0, step_timeout_s: float = 60.0) -> None:
        self.engine = engine
        self.redis = redis
        self.inbox = Inbox(redis, model, worker_id, shard)
        self.publisher = EventPublisher(redis, model, worker_id, events_ttl_s, shard)
        self.spans = RequestSpans(worker_id)
        self.max_inbox_batches = max_inbox_batches
        self.state = LoopState()
        self.accepting = True
        self.snapshot: EngineStats = engine.stats()
        self.step_timeout_s = step_timeout_s
        self._stop = asyncio.Event()
        self.step_thread = StepThread("engine-step")
        self._last_preemptions = 0

    # --- lifecycle ---------------------------------------------------------------------------
    async def run(self) -> None:
        await self.inbox.ensure_group()
        while not self._stop.is_set():
            try:
                await self._turn()
            except UNAVAILABLE_ERRORS as exc:
                logger.warning("redis unavailable; retrying", error=repr(exc))
                await asyncio.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()

    def close(self, wait: bool = True) -> None:
        """Stop the step thread; `wait=False` after a failure (a hung step never ends)."""
        self.step_thread.close(wait)

    @property
    def busy(self) -> bool:
        """Sequences still running/waiting, or events not yet written."""
        return self.engine.has_work() or bool(self.state.unpublished or self.state.unacked)

    # --- one turn ----------------------------------------------------------------------------
    async def _turn(self) -> None:
        read_inbox = self.accepting and self.engine.can_take_more()
        if read_inbox and not (self.busy and self.inbox.caught_up):
            entries = await self.inbox.read(self.max_inbox_batches, None if self.busy else IDLE_BLOCK_MS)
            for arrival in await self._arrivals(entries):
                self._accept(arrival)
            read_inbox = False
        live = [t for t in self.state.tracked.values() if not t.seq.is_finished]
        step = self.step_thread.submit(self._step) if self.engine.has_work() else None
        try:
            apply_replies = await self._exchange(live, read_inbox)
        finally:
            if step is not None:                     # even when the exchange failed: keep its tokens
                self._emit_outputs(await self._step_done(step))
        apply_replies()
        if step is None and not self.accepting:
            await asyncio.sleep(0.02)
        self._take_snapshot()

    async def _exchange(self, live: list[Tracked], read_inbox: bool) -> Callable[[], None]:
        """One round trip: the queued events, the cancel keys of the `live` requests, a read of new
        inbox entries (no wait) when `read_inbox`, then the acks of finished entries. Touches no
        engine state (a step may be running): returns what applies the replies to the engine. On
        a Redis error the events and acks stay queued, and entries the lost read delivered are
        read again from this worker's pending list."""
        emissions, acks = self.state.unpublished, self.state.unacked
        if not (live or emissions or acks or read_inbox):
            return lambda: None
        self.state.unpublished, self.state.unacked = [], []
        pipe = self.redis.pipeline(transaction=False)
        self.publisher.queue_events(pipe, emissions)
        for t in live:
            pipe.exists(*t.cancel_keys)
        if read_inbox:
            self.inbox.queue_read(pipe, self.max_inbox_batches)
        self.publisher.queue_acks(pipe, acks)
        try:
            replies = await pipe.execute()
        except BaseException:
            self.state.unpublished[:0], self.state.unacked[:0] = emissions, acks
            if read_inbox:
                self.inbox.reread_pending()
            raise
        refused = self.publisher.refused(emissions, replies)
        cancelled = replies[len(emissions):len(emissions) + len(live)]
        entries = await self.inbox.entries(replies[len(emissions) + len(live)]) if read_inbox else []
        arrivals = await self._arrivals(entries)

        def apply() -> None:
            self._stop_fenced(refused)
            self._stop_cancelled_and_expired(live, cancelled)
            for arrival in arrivals:
                self._accept(arrival)
        return apply

    def _step(self) -> list[StepOutput]:
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        new_tokens = sum(len(o.new_token_ids) for o in outputs)
        metrics.STEP_SECONDS.observe(elapsed)
        stats = self.engine.stats()
        metrics.BATCH_TOKENS.observe(stats.last_batch_tokens)
        metrics.observe_roofline(stats.roofline)
        metrics.GENERATED.inc(new_tokens)
        metrics.DRAFT_TOKENS.inc(sum(o.draft_tokens for o in outputs))
        metrics.ACCEPTED_DRAFT_TOKENS.inc(sum(o.accepted_draft_tokens for o in outputs))
        metrics.TOKENS_PER_S.set(new_tokens / elapsed if elapsed > 0 else 0.0)
        return outputs

    async def _step_done(self, step: asyncio.Future[list[StepOutput]]) -> list[StepOutput]:
        """The step's outputs, waiting at most until it has run step_timeout_s (the watchdog)."""
        left = self.step_timeout_s - self.step_thread.running_for()
        try:
            async with asyncio.timeout(max(0.0, left)):
                return await step
        except TimeoutError:
            raise StepTimeout(f"an engine step ran for more than {self.step_timeout_s} s "
                              f"(thread {self.step_thread.name}, native id {self.step_thread.native_id})") from None

    async def _arrivals(self, entries: list[InboxEntry]) -> list[Arrival]:
        """New entries' requests, validated and their grammars compiled in a thread: a new schema
        or the first vocabulary load takes seconds the heartbeat cannot wait."""
        if not entries:
            return []
        return await asyncio.to_thread(lambda: [self._arrival(entry) for entry in entries])

    def _arrival(self, entry: InboxEntry) -> Arrival:
        requests = []
        for item in entry.batch.items:
            problem = validate_item(item, self.engine.vocab_size)
            for tracked in Tracked.choices_of(item, entry.entry_id):
                if not problem:
                    self.engine.prepare(tracked.seq)
                requests.append((tracked, problem))
        return Arrival(entry, requests)

    def _accept(self, arrival: Arrival) -> None:
        entry = arrival.entry
        if entry.entry_id in self.state.entries or entry.entry_id in self.state.unacked:
            return                                   # read again after a lost reply: already here
        open_ids: set[int] = set()
        self.state.entries[entry.entry_id] = open_ids
        for tracked, problem in arrival.requests:
            self.state.tracked[tracked.seq.seq_id] = tracked
            open_ids.add(tracked.seq.seq_id)
            self._admit(tracked, problem)
        logger.info("batch accepted", batch_id=entry.batch.batch_id, entry_id=entry.entry_id,
                    items=len(entry.batch.items))
        if not open_ids:
            self._close_entry(entry.entry_id)

    def _admit(self, tracked: Tracked, problem: str) -> None:
        if problem:
            self._queue(Emission(tracked, final=True, error=InvalidArgument("prompt_token_ids", problem)))
        elif tracked.expired(now_ms()):
            self._queue(Emission(tracked, final=True,
                                 error=DeadlineExceeded("deadline passed before the worker started")))
        elif (done := self.engine.add(tracked.seq)) is not None:
            if done.seq.failure is Failure.BAD_CONSTRAINT:
                self._queue(Emission(tracked, final=True, error=InvalidArgument(
                    "sampling.response_format", "the grammar cannot continue this request's tokens")))
            else:
                self._queue(Emission(tracked, final=True, finish_reason=done.seq.finish_reason))
        else:
            self.spans.admitted(tracked)

    def _stop_cancelled_and_expired(self, live: list[Tracked], cancelled: list) -> None:
        """Abort the live requests whose cancel key exists, or the choices whose own one does
        (`cancelled`, one count each), or whose deadline passed."""
        at = now_ms()
        for t, flag in zip(live, cancelled):
            if t.done or t.seq.is_finished:
                continue                             # stopped meanwhile (fenced)
            if flag:
                self.engine.abort(t.seq, FINISH_CANCELLED)
                self._queue(Emission(t, final=True, finish_reason=FINISH_CANCELLED))
            elif t.expired(at):
                self.engine.abort(t.seq, 0, Failure.DEADLINE)
                self._queue(Emission(t, final=True, error=DeadlineExceeded("deadline exceeded during generation")))

    def _emit_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            tracked = self.state.tracked[out.seq.seq_id]
            self.spans.stepped(tracked, len(out.new_token_ids))
            if out.seq.failure is Failure.DOES_NOT_FIT:
                self._queue(Emission(tracked, final=True, error=ResourceExhausted(
                    "kv_cache", 0, "prompt does not fit in this worker's KV cache")))
            else:
                self._queue(Emission(tracked, tuple(out.new_token_ids), final=out.finished,
                                     finish_reason=out.seq.finish_reason))

    # --- events and acks ---------------------------------------------------------------------
    def _queue(self, emission: Emission) -> None:
        index = emission.tracked.seq.num_generated - len(emission.token_ids)
        self.state.unpublished.append(dataclasses.replace(emission, index=index))
        if emission.final:
            reason = emission.error.code.name if emission.error else str(emission.finish_reason)
            metrics.FINISHED.labels(reason=reason).inc()
            self.spans.ended(emission.tracked, emission.finish_reason, emission.error.message if emission.error else "")
            self._forget(emission.tracked)

    def _forget(self, tracked: Tracked) -> None:
        """The request ended here: stop tracking it; ack its batch once all of the batch ended."""
        self.state.tracked.pop(tracked.seq.seq_id, None)
        open_ids = self.state.entries.get(tracked.entry_id)
        if open_ids is not None:
            open_ids.discard(tracked.seq.seq_id)
            if not open_ids:
                self._close_entry(tracked.entry_id)

    def _close_entry(self, entry_id: str) -> None:
        self.state.entries.pop(entry_id, None)
        self.state.unacked.append(entry_id)

    async def flush(self) -> None:
        """Write queued events, then ack entries; on a Redis error both stay queued for the next turn."""
        emissions, acks = self.state.unpublished, self.state.unacked
        self.state.unpublished, self.state.unacked = [], []
        try:
            refused = await self.publisher.publish(emissions, acks)
        except BaseException:
            self.state.unpublished[:0], self.state.unacked[:0] = emissions, acks
            raise
        self._stop_fenced(refused)

    def _stop_fenced(self, refused: list[Emission]) -> None:
        """Requests dispatched again elsewhere (we were declared dead): stop them, write nothing more."""
        for tracked in {id(e.tracked): e.tracked for e in refused}.values():
            if tracked.done:
                continue
            tracked.done = True
            self.engine.abort(tracked.seq, 0, Failure.SUPERSEDED)
            self.spans.moved(tracked, "superseded")
            self._forget(tracked)
            self.state.unpublished = [e for e in self.state.unpublished if e.tracked is not tracked]
            metrics.FENCED.inc()
            logger.warning("request was dispatched again elsewhere; stopped here",
                           request_id=tracked.item.request_id, tenant=tracked.item.tenant,
                           epoch=tracked.item.dispatch_epoch, **tracing.log_fields(tracked.item))

    def _take_snapshot(self) -> None:
        self.snapshot = s = self.engine.stats(prefix_hashes=ADVERTISED_PREFIX_HASHES)
        metrics.PREEMPTIONS.inc(s.preemptions - self._last_preemptions)
        if s.preemptions > self._last_preemptions:
            self.spans.check_preempted(self.state.tracked.values())
        self._last_preemptions = s.preemptions
        metrics.RUNNING.set(s.running)
        metrics.WAITING.set(s.waiting)
        metrics.KV_USAGE.set(s.kv_usage)
        metrics.PREFIX_HIT_RATE.set(s.prefix_hit_rate)

    # --- drain -------------------------------------------------------------------------------
    def unfinished(self) -> list[Tracked]:
        return list(self.state.tracked.values())

    async def read_unread_inbox(self) -> list[InboxEntry]:
        """Entries dispatched to this worker that it never started (for handoff)."""
        out: list[InboxEntry] = []
        while batch := await self.inbox.read(64, None):
            out += batch
        return out

    def items_to_hand_back(self, unread: list[InboxEntry]) -> tuple[list[queue_pb2.WorkItem], list[str]]:
        """(work items to requeue, inbox entries to ack) for everything not finished here."""
        items = handoff_items(self.unfinished())
        for tracked in self.unfinished():
            self.spans.moved(tracked, "handed back")
        items += [item for entry in unread for item in entry.batch.items]
        entries = [*self.state.entries, *(e.entry_id for e in unread)]
        return items, entries
