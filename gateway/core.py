"""The gateway's one core object: everything a call needs, built once by `__main__` and injected
into both fronts (gateway/grpc_front.py, gateway/openai_http.py), which only translate.

    Gateway ─ tenants (auth)      redis, blocking (event reads)   router (alias → NAME@VERSION)
            ─ tokenizers (tokenizer_svc client, model infos)      quota (Lua)
            ─ formats (response_format compiles)                  flow (one request end to end)

    start ─▶ serving ─▶ drain (no new requests; streams go on) ─▶ close
      │
      └ waits for Redis (redis_wait_s, llmserve/redis_client.connect_when_up) and tokenizer_svc:
        until both answer, health is NOT_SERVING and every call UNAVAILABLE (HTTP 503), retryable.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

from gateway.calls import ratelimit_headers, rejection
from gateway.config import GatewaySettings
from gateway.flow import Flow, limits_of
from gateway.model_router import Router
from gateway.quota import Quota
from gateway.request_state import Call
from gateway.response_format import FormatCompiler
from gateway.tenants import TenantRegistry
from gateway.tokenizer_client import TokenizerClient
from gateway.validation import check_input
from llmserve.runtime import redis_client
from llmserve.runtime.errors import InvalidArgument, Unavailable
from llmserve.runtime.tasks import TaskSupervisor
from llmserve.v1 import inference_pb2 as pb


class Gateway:
    """Auth, quotas, validation, admission and streaming, whichever front the call came through."""

    def __init__(self, settings: GatewaySettings, stop: asyncio.Event | None = None) -> None:
        self.settings = settings
        self.stop_event = stop
        self.failure: BaseException | None = None
        self.tasks = TaskSupervisor(on_failure=self._fail)
        self.tenants = TenantRegistry(settings.tenants).load()
        self.models = settings.models_config()
        self.tokenizers = TokenizerClient(self.models.ids, settings.tokenizer_target, settings.tokenizer_timeout_s)
        self.formats = FormatCompiler(settings.grammar_compile_timeout_s, settings.grammar_threads)
        self.redis: redis_client.AnyRedis | None = None      # from start() on; with it the parts below
        self.blocking: redis_client.AnyRedis | None = None
        self.router: Router
        self.quota: Quota
        self.flow: Flow
        self.started = False
        self.serving = False

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Wait for Redis and tokenizer_svc, load the model infos, start routing; then serve."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.tenants.reload)
        await self._connect()
        await self.tokenizers.load(self.settings.tokenizer_wait_s)
        await self.router.start()
        self.tasks.start("routes-refresh", self.router.run())
        self.started = self.serving = True

    def _fail(self, exc: BaseException) -> None:
        """A task died (logged by the supervisor): serve() goes NOT_SERVING and exits 1."""
        self.failure = exc
        if self.stop_event is not None:
            self.stop_event.set()

    async def _connect(self) -> None:
        """The Redis clients (once Redis answers) and everything that talks through them."""
        settings = self.settings
        self.redis = await redis_client.connect_when_up(settings.redis_url, settings.redis_password,
                                                        wait_s=settings.redis_wait_s)
        self.blocking = await redis_client.connect_when_up(settings.redis_url, settings.redis_password,
                                                           wait_s=settings.redis_wait_s, socket_timeout=10.0,
                                                           max_connections=settings.max_streams)
        self.router = Router(self.models, self.redis, settings.route_refresh_ms / 1000,
                             settings.worker_heartbeat_ttl_ms, settings.queue_shards)
        self.quota = Quota(self.redis, settings.lease_ttl_s, settings.concurrency_retry_ms)
        self.flow = Flow(settings, self.redis, self.blocking, self.tokenizers, self.quota, self.router, self.formats)

    def check_serving(self) -> None:
        """Refuse a call while the gateway is not serving (starting, or draining); retryable.

        Raises:
            Unavailable: saying which.
        """
        if self.serving:
            return
        if self.started:
            raise Unavailable("draining: this gateway takes no new requests; retry")
        raise Unavailable("starting: waiting for redis and tokenizer_svc; retry")

    async def drain(self) -> None:
        """No new requests from here on (both fronts refuse them); in-flight streams go on."""
        self.serving = False

    async def close(self) -> None:
        if self.redis is not None and self.blocking is not None:
            await self.flow.drain()
            await self.tasks.cancel_all()
            await self.redis.aclose()
            await self.blocking.aclose()
        await self.tokenizers.close()
        self.formats.close()

    # -- what a call can ask -------------------------------------------------------------------------------
    def generate(self, call: Call, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        return self.flow.generate(call, request)

    async def cancel(self, call: Call, request_id: str) -> None:
        if not request_id:
            raise InvalidArgument("request_id", "required")
        await self.flow.cancel_owned(call.tenant.id, request_id)

    async def tokenize(self, call: Call, request: pb.TokenizeRequest) -> list[int]:
        """Token ids of the request's text or messages; counted against the tenant's request rate
        (it uses the shared tokenizer pool) before the tokenizer is asked."""
        model = self.flow.model_for(call, request)
        check_input(request.text, request.messages, self.flow.limits, prompt_field="text")
        decision = await self.quota.charge_request(limits_of(call.tenant))
        if not decision.admitted:
            raise rejection(call.tenant.id, decision)
        return await self.tokenizers.encode(model.id, request.text, request.messages, call.deadline,
                                            call.tenant.raw_special_tokens)

    def models_for(self, call: Call) -> list[pb.ModelInfo]:
        """The models and aliases the caller's tenant may use."""
        return [m for m in self.model_infos() if call.tenant.may_use(m.id)]

    def model_infos(self) -> list[pb.ModelInfo]:
        """Concrete models, then aliases with their current weights; the default one marked."""
        default = self.models.default_name
        concrete = self.tokenizers.list()
        for info in concrete:
            info.kind, info.is_default = pb.MODEL_KIND_CONCRETE, info.id == default
            if (facts := self.router.facts_of(info.id)) is not None:
                info.architecture, info.weight_format = facts.architecture, facts.weight_format
        aliases = [pb.ModelInfo(id=alias, kind=pb.MODEL_KIND_ALIAS, is_default=alias == default,
                                context_length=min(self.tokenizers.context_length(m) for m in weights),
                                routes=[pb.RouteWeight(model=m, weight=w) for m, w in sorted(weights.items())])
                   for alias, weights in self.router.aliases().items()]
        return concrete + aliases

    async def remaining(self, call: Call) -> list[tuple[str, str]]:
        """The x-ratelimit-* headers of the caller's tenant now (charging nothing)."""
        return ratelimit_headers(*await self.quota.peek(limits_of(call.tenant)))
