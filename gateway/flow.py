"""One Generate/Complete request, from admission to the last chunk.

    every stream: a slot among this gateway's streams of the tenant (max_tenant_streams)
    new request:  model check → validate (cheap: shapes, ranges, sizes) → shed check
                  → quota admit (rate + lease, one Lua call) → compile response_format (off the
                  loop) → tokenize → resolve sampling → reserve tokens (one Lua call)
                  → claim request meta → XADD WorkItem (to a queue cell with live workers,
                  llmserve/protocol/queue_cells.py); a failure after the admit gives the lease back
    both:         XREAD BLOCK the events stream → OutputBuilder → chunks
    resume:       request meta of the same tenant exists → attach from 0 / x-resume-from;
                  the only viewer of a request that holds its lease carries that lease on,
                  any other viewer takes a lease of its own (max_concurrent) while attached

Exit paths (every one gives the lease back):

    final event / stop string    release + refund unused tokens (stop: set cancel key)
    deadline / max queue wait    set cancel key at once, release
    client gone, or Redis lost   after detach_grace_s with no resumed viewer: cancel, release
    gateway killed               nothing runs; the lease expires (TTL), the worker finishes
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import cast

import structlog

from gateway import choices, metrics, slo
from gateway.calls import REMAINING_REQUESTS, ratelimit_headers, rejection
from gateway.config import GatewaySettings
from gateway.model_router import Router
from gateway.quota import Limits, Quota
from gateway.request_clock import QueueWaitExceeded, Watch
from gateway.request_record import RequestRecord
from gateway.request_state import Call, Meta, StreamOutcome
from gateway.response_format import FormatCompiler
from gateway.shedding import Shedder
from gateway.stream_slots import TenantStreams, ViewerLease
from gateway.tenants import Tenant
from gateway.tokenizer_client import ModelInfo, TokenizerClient
from gateway.validation import RequestLimits, check_request_id, resolve_sampling, validate_request
from llmserve.protocol import keys, queue
from llmserve.protocol.queue_cells import CellChooser
from llmserve.runtime import redis_client, tracing
from llmserve.runtime.clock import now_ms
from llmserve.runtime.errors import DeadlineExceeded, InvalidArgument, NotFound, PermissionDenied, Unavailable
from llmserve.runtime.log import bind_model
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)




def limits_of(tenant: Tenant) -> Limits:
    return Limits(tenant.id, tenant.requests_per_second, tenant.burst, tenant.tokens_per_minute,
                  tenant.max_concurrent)


class Flow:
    """Runs requests; owns no per-request state (that lives in `Call` and locals)."""

    def __init__(self, settings: GatewaySettings, redis: redis_client.AnyRedis, blocking: redis_client.AnyRedis,
                 tokenizers: TokenizerClient, quota: Quota, router: Router, formats: FormatCompiler) -> None:
        self.settings = settings
        self.formats = formats
        self.redis = redis
        self.blocking = blocking
        self.tokenizers = tokenizers
        self.router = router
        self.quota = quota
        self.shedder = Shedder(redis, settings.queue_max_depth, settings.high_reserved_share, settings.queue_shards)
        self.cells = CellChooser(redis, settings.queue_shards)
        self.limits = RequestLimits(settings.max_prompt_bytes, settings.max_messages, settings.max_stop_strings,
                                    settings.max_stop_chars, settings.max_request_id_chars,
                                    settings.default_max_new_tokens)
        self.streams = TenantStreams(settings.max_tenant_streams, settings.concurrency_retry_ms)
        self._background: set[asyncio.Task] = set()

    # -- entry ---------------------------------------------------------------------------------------------
    async def generate(self, call: Call, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        check_request_id(request.request_id, self.limits)
        tracing.describe_request(call.tenant.id, request)
        with self.streams.slot(call.tenant.id):
            meta = await self._meta(call) if request.request_id else None
            if meta is None:
                meta = await self._submit(call, request)
                if meta is None:  # lost a race with a concurrent identical request_id: attach to it
                    meta = await self._meta(call)
            elif meta.error:  # a resume of a request that failed before it started fails the same way
                raise Unavailable(meta.error)
            else:
                call.headers = ratelimit_headers(*await self.quota.peek(limits_of(call.tenant)))
            if meta is None:  # claimed by a concurrent submit that has not finished (or failed): retry
                raise Unavailable(f"request {call.request_id} is being submitted; retry to attach")
            self._served(call, meta.model)  # a resume stays on the version it started on
            async for chunk in self._stream(call, meta):
                if chunk.HasField("usage"):
                    metrics.completed(request, meta.model, chunk)
                yield chunk

    async def _meta(self, call: Call) -> Meta | None:
        return await self._record(call).read()

    def _record(self, call: Call) -> RequestRecord:
        return RequestRecord(self.redis, call.tenant.id, call.request_id)

    # -- admission -----------------------------------------------------------------------------------------
    def model_for(self, call: Call, request) -> ModelInfo:
        """The concrete model serving a request (alias by weight, or the pinned version), if its
        tenant may use both the name it asked for and that concrete id."""
        route = self.router.route(request.model, call.model_version, call.request_id)
        for name in dict.fromkeys((route.requested, route.model)):
            if not call.tenant.may_use(name):
                raise PermissionDenied(f"tenant {call.tenant.id} may not use model {name}")
        self._served(call, route.model)
        return self.tokenizers.get(route.model)

    @staticmethod
    def _served(call: Call, model: str) -> None:
        """Record the concrete model: x-served-model header, `model` on every later log line."""
        call.served_model = model
        call.headers = [h for h in call.headers if h[0] != "x-served-model"] + [("x-served-model", model)]
        bind_model(model)

    async def _submit(self, call: Call, request: pb.GenerateRequest) -> Meta | None:
        arrival = now_ms()
        with tracing.span("admission"):
            model = self.model_for(call, request)
            validate_request(request, self.limits)
            priority = request.priority or call.tenant.priority
            targets = slo.resolve(slo.from_request(request), call.slo_asked, call.tenant)
            ahead = await self.shedder.check(model.id, priority, call.tenant.id)
            await self._admit(call)
        try:
            prompt_ids, sampling = await self._prepare(call, request, model)
            if call.tenant.shed_unmeetable:
                self.shedder.check_slo(model.id, priority, call.tenant.id, targets.ttft_ms, now_ms() - arrival,
                                       ahead, len(prompt_ids))
            call.slo = slo.Admitted(targets, priority, ahead)
            n = choices.count(request)
            cost = choices.reserved_tokens(len(prompt_ids), sampling.max_new_tokens, n)
            await self._reserve(call, cost)
            meta = Meta(call.tenant.id, model.id, len(prompt_ids), cost, list(request.sampling.stop), arrival, 0,
                        n=n)
            claimed = await self._claim(call, meta)
        except BaseException:
            self._spawn(self.quota.release(limits_of(call.tenant), call.request_id, 0))
            raise
        if not claimed:
            await self.quota.release(limits_of(call.tenant), call.request_id, 0)
            return None
        item = self._work_item(call, meta, prompt_ids, sampling, priority)
        await self._enqueue(call, meta, item)
        return meta

    async def _prepare(self, call: Call, request: pb.GenerateRequest,
                       model: ModelInfo) -> tuple[list[int], queue_pb2.ResolvedSampling]:
        """The costly part, run only for an admitted request: compile its format, tokenize its prompt."""
        await self.formats.check(request.sampling.response_format, call.tenant.id)
        tool_grammar = await self.formats.tool_grammar(request, call.tenant.id)
        prompt_ids = await self.tokenizers.encode(model.id, request.prompt, request.messages, call.deadline,
                                               call.tenant.raw_special_tokens, request.tools)
        sampling = resolve_sampling(request.sampling, len(prompt_ids), model.context_length,
                                    call.tenant.max_new_tokens, self.limits)
        sampling.tool_grammar = tool_grammar
        if not request.sampling.ignore_eos:
            sampling.stop_token_ids.extend(model.eos_token_ids)
        cost = choices.reserved_tokens(len(prompt_ids), sampling.max_new_tokens, choices.count(request))
        if cost > call.tenant.tokens_per_minute:
            raise InvalidArgument("sampling.max_new_tokens", f"(prompt + max_new_tokens) * n = {cost} exceeds the "
                                                             f"tenant's tokens_per_minute")
        return prompt_ids, sampling

    async def _admit(self, call: Call) -> None:
        """Rate and concurrency, before anything costly (the tokens follow once counted)."""
        started = time.perf_counter()
        decision = await self.quota.admit(limits_of(call.tenant), call.request_id, 0)
        metrics.ADMISSION.observe(time.perf_counter() - started)
        if not decision.admitted:
            if decision.limit == "duplicate":
                raise Unavailable(f"request {call.request_id} is being admitted; retry to attach")
            raise rejection(call.tenant.id, decision)
        call.headers = ratelimit_headers(decision.remaining_requests, decision.remaining_tokens)

    async def _reserve(self, call: Call, cost: int) -> None:
        decision = await self.quota.reserve(limits_of(call.tenant), call.request_id, cost)
        if not decision.admitted:
            if decision.limit == "lease_expired":
                raise Unavailable(f"request {call.request_id} was admitted too long ago; retry")
            raise rejection(call.tenant.id, decision)
        requests = dict(call.headers).get(REMAINING_REQUESTS, "0")
        call.headers = ratelimit_headers(int(requests), decision.remaining_tokens)

    async def _claim(self, call: Call, meta: Meta) -> bool:
        """Make this gateway the request's creator; False when the same request_id was claimed first."""
        return await self._record(call).claim(self.settings.events_ttl_s)

    def _work_item(self, call: Call, meta: Meta, prompt_ids: list[int], sampling: queue_pb2.ResolvedSampling,
                   priority: int) -> queue_pb2.WorkItem:
        deadline_ms = 0 if call.deadline is None else now_ms() + int((call.deadline - time.monotonic()) * 1000)
        meta.enqueued_ms = now_ms()
        return queue_pb2.WorkItem(
            request_id=call.request_id, tenant=call.tenant.id, model=meta.model, prompt_token_ids=prompt_ids,
            sampling=sampling, priority=cast(pb.Priority, priority), deadline_unix_ms=deadline_ms,
            arrival_unix_ms=meta.arrival_ms,
            enqueued_unix_ms=meta.enqueued_ms, events_key=keys.events_stream(call.tenant.id, call.request_id),
            cancel_key=keys.cancel_key(call.tenant.id, call.request_id), cache_salt=call.tenant.cache_salt,
            tenant_weight=call.tenant.weight, trace_context=tracing.inject(), n=meta.n,
            slo_ttft_ms=call.slo.targets.ttft_ms if call.slo else 0,
            slo_tpot_ms=call.slo.targets.tpot_ms if call.slo else 0)

    async def _enqueue(self, call: Call, meta: Meta, item: queue_pb2.WorkItem) -> None:
        record = self._record(call)
        shard = await self.cells.choose(meta.model, keys.request_uid(call.tenant.id, call.request_id))
        meta.work_key = keys.work_stream(meta.model, item.priority, shard)
        try:
            await record.write(meta)
            entry_id = await self.redis.xadd(meta.work_key, queue.item_entry(item))
            meta.entry_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            await record.set_entry(meta.entry_id)
        except Exception:
            await record.delete()
            await self.quota.release(limits_of(call.tenant), call.request_id, 0)
            raise

    # -- streaming -----------------------------------------------------------------------------------------
    async def _stream(self, call: Call, meta: Meta) -> AsyncIterator[pb.GenerateResponse]:
        model = self.tokenizers.get(meta.model)
        builder = choices.ChoicesBuilder(call.request_id, model.tokenizer, meta.stops, meta.n)
        watch = Watch(self.settings, self.redis, self.quota, call, meta)
        stream_slo = slo.StreamSlo(self.shedder.estimate, call.slo, call.tenant.id, meta.model, meta.enqueued_ms)
        lease = await self._attach(call)
        metrics.IN_FLIGHT.inc()
        span = tracing.start_span("stream")
        outcome, failure = StreamOutcome.DETACHED, ""
        try:
            async for event in self._events(call, watch, lease):
                chunk = builder.feed(event)
                if chunk is None:
                    continue
                if builder.ended_alone(chunk, event):
                    await choices.cancel_choice(self.redis, call.tenant.id, call.request_id, chunk.choice_index,
                                                self.settings.events_ttl_s)
                watch.observe_chunk(chunk, model.id, builder)
                if builder.done:
                    chunk.usage.CopyFrom(watch.usage(builder, meta))
                    outcome = StreamOutcome.STOPPED if chunk.finish_reason == pb.FINISH_REASON_STOP and \
                        not event.final else StreamOutcome.FINISHED
                stream_slo.chunk(chunk, watch)
                if chunk.index >= call.resume_from:
                    yield chunk
                if builder.done:
                    return
            outcome = StreamOutcome.CANCELLED  # the cancel grace ran out without a final event
            yield watch.cancelled_chunk(builder, meta)
        except QueueWaitExceeded as exc:
            outcome, failure = StreamOutcome.ABANDONED, exc.message
            raise
        except (DeadlineExceeded, Unavailable):
            outcome = StreamOutcome.ABANDONED
            raise
        except redis_client.UNAVAILABLE_ERRORS:
            raise   # the caller gets UNAVAILABLE and may resume: DETACHED, like a client gone
        except Exception:
            outcome = StreamOutcome.FINISHED if builder.done else StreamOutcome.ABANDONED
            raise
        finally:
            metrics.IN_FLIGHT.dec()
            tracing.end_span(span, {tracing.OUTPUT_TOKENS: builder.next_index, "llmserve.stream.outcome": outcome.value})
            self._spawn(self._finish(call, meta, builder, outcome, failure, lease))

    async def _attach(self, call: Call) -> ViewerLease | None:
        """Count this viewer. The only viewer of a request that still holds its lease carries that
        lease on (None); any other (a second viewer, a replay of a finished request) takes a lease
        of its own, or the attach is RESOURCE_EXHAUSTED at the tenant's max_concurrent."""
        record = self._record(call)
        viewers = await record.add_viewer(1)
        if viewers == 1 and await self.quota.holds(call.tenant.id, call.request_id):
            return None
        try:
            return await ViewerLease.take(self.quota, limits_of(call.tenant), call.request_id,
                                          self.settings.lease_ttl_s)
        except BaseException:
            await record.add_viewer(-1)
            raise

    async def _events(self, call: Call, watch: Watch,
                      lease: ViewerLease | None) -> AsyncIterator[queue_pb2.TokenEvent]:
        key = keys.events_stream(call.tenant.id, call.request_id)
        last_id = "0-0"
        while True:
            block = watch.block_ms()
            reply = cast(redis_client.StreamReply, await self.blocking.xread({key: last_id}, count=256, block=block))
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    last_id = redis_client.text(entry_id)
                    event = queue.decode_event(fields)
                    watch.saw_event(event)
                    yield event
            if lease is not None:
                await lease.keep()
            if not await watch.tick(bool(reply)):
                return

    # -- exits ---------------------------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        """Run cleanup to completion even when the handler task is being cancelled."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _finish(self, call: Call, meta: Meta, builder: choices.ChoicesBuilder, outcome: StreamOutcome,
                      failure: str = "", lease: ViewerLease | None = None) -> None:
        record = self._record(call)
        used = meta.prompt_tokens * meta.n + builder.next_index
        try:
            if lease is not None:  # this viewer's own slot frees as it leaves
                await lease.drop()
            if failure:
                await record.fail(failure)
            viewers = await record.add_viewer(-1)
            if outcome is StreamOutcome.DETACHED:
                await asyncio.sleep(self.settings.detach_grace_s)
                if await record.carried_on():
                    return  # a resumed viewer carries on and will release
                logger.info("client gone; cancelling", viewers=viewers)
            if outcome.cancels_the_request:
                await self.cancel(call.tenant.id, call.request_id)
            else:
                await record.mark_done()
            await record.keep_for(self.settings.events_ttl_s)  # outlive the events stream
            await self.quota.release(limits_of(call.tenant), call.request_id, used)
        except Exception as exc:  # noqa: BLE001 - background cleanup; the lease TTL is the backstop
            logger.warning("cleanup failed; lease will expire", error=repr(exc))

    async def cancel(self, tenant: str, request_id: str) -> None:
        """Set the cancel key (worker and batcher stop the request) and mark the request done."""
        ttl = self.settings.events_ttl_s
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(keys.cancel_key(tenant, request_id), "1", ex=ttl)
            RequestRecord(self.redis, tenant, request_id).mark_done_in(pipe)
            await pipe.execute()

    async def cancel_owned(self, tenant: str, request_id: str) -> None:
        """The Cancel RPC: only a request of this tenant; anything else is NOT_FOUND."""
        if await RequestRecord(self.redis, tenant, request_id).owner() != tenant:
            raise NotFound(f"no request {request_id!r}")
        await self.redis.set(keys.cancel_key(tenant, request_id), "1", ex=self.settings.events_ttl_s)

    async def drain(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.settings.grace_s)

