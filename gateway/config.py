"""Gateway settings: one typed object, read once at start-up (flags, env LLMSERVE_*, defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.catalog.models_file import ModelsConfig, ModelsFileError, from_setting
from llmserve.runtime.settings import CommonSettings, SettingsError, require, setting


@dataclass
class GatewaySettings(CommonSettings):
    """Everything `python -m gateway` can be told; see `--help`."""

    tenants: str = setting("", "tenants YAML file (reloaded on SIGHUP)")
    tokenizer_target: str = setting("127.0.0.1:50052", "tokenizer_svc address HOST:PORT")
    models: str = setting("smollm2-135m", "comma list of model specs (alias, path or ID=PATH; the first is the "
                                          "default), or @FILE: a models file with versions and aliases")
    route_refresh_ms: int = setting(250, "how often alias weights (llmserve route) and worker liveness are re-read")
    worker_heartbeat_ttl_ms: int = setting(3000, "a worker whose heartbeat is older is not live for alias routing")
    default_max_new_tokens: int = setting(256, "max_new_tokens when the request leaves it unset (capped by tenant)")
    max_prompt_bytes: int = setting(1_000_000, "largest prompt (or sum of message contents) in UTF-8 bytes")
    max_messages: int = setting(512, "most chat messages per request")
    max_stop_strings: int = setting(8, "most stop strings per request")
    max_stop_chars: int = setting(64, "longest stop string in characters")
    max_request_id_chars: int = setting(128, "longest caller-chosen request_id")
    max_message_bytes: int = setting(16 * 1024 * 1024, "largest gRPC message the server accepts")
    queue_max_depth: int = setting(256, "work items queued per model (all priorities) before shedding")
    high_reserved_share: float = setting(0.25, "share of queue_max_depth only HIGH priority may use")
    max_queue_wait_s: float = setting(60.0, "longest a request waits for a worker before UNAVAILABLE")
    events_ttl_s: int = setting(600, "TTL of per-request token-event streams and request metadata")
    lease_ttl_s: float = setting(30.0, "TTL of a concurrency lease (renewed while the request runs)")
    concurrency_retry_ms: int = setting(200, "retry-after-ms hint when max_concurrent is reached")
    tokenizer_timeout_s: float = setting(5.0, "per-call timeout of tokenizer_svc calls")
    tokenizer_wait_s: float = setting(120.0, "how long start-up waits for tokenizer_svc")
    detach_grace_s: float = setting(2.0, "after a client disconnects (or a stream loses Redis), how long a "
                                         "resume may re-attach before the request is cancelled")
    cancel_grace_s: float = setting(3.0, "after a cancel, how long to wait for the worker's final event")
    max_streams: int = setting(1024, "Redis connections for blocking event reads")
    http_port: int = setting(0, "OpenAI-compatible HTTP port (0 = off, -1 = a free one, reported in "
                                "http_port_file)")
    http_port_file: str = setting("", "write the bound HTTP port to this file once listening")
    http_request_timeout_s: float = setting(600.0, "deadline of an OpenAI HTTP request (HTTP carries none of its "
                                                   "own; gRPC callers set theirs): 504 after it")
    max_http_body_bytes: int = setting(4 * 1024 * 1024, "largest OpenAI HTTP request body (413 beyond it; "
                                                         "refused while it is read, never buffered whole)")
    grammar_compile_timeout_s: float = setting(5.0, "longest a request waits for its response_format to compile "
                                                    "(INVALID_ARGUMENT after it)")
    grammar_threads: int = setting(1, "threads compiling response formats (shared by every tenant; off the "
                                      "event loop)")
    max_tenant_streams: int = setting(256, "most Generate/Complete streams one tenant may have open on this "
                                           "gateway (re-attached ones included)")

    def validate(self) -> None:
        super().validate()
        require(bool(self.tenants), "tenants", "a tenants file is required (--tenants or LLMSERVE_TENANTS)")
        self.models_config()
        require(50 <= self.route_refresh_ms <= 1000, "route_refresh_ms", "must be in 50..1000 (a route change "
                                                                           "reaches every gateway within it)")
        require(self.worker_heartbeat_ttl_ms > 0, "worker_heartbeat_ttl_ms", "must be > 0")
        require(":" in self.tokenizer_target, "tokenizer_target", "must be HOST:PORT")
        require(self.default_max_new_tokens >= 1, "default_max_new_tokens", "must be >= 1")
        require(self.queue_max_depth >= 1, "queue_max_depth", "must be >= 1")
        require(0.0 <= self.high_reserved_share < 1.0, "high_reserved_share", "must be in [0, 1)")
        require(self.max_queue_wait_s > 0, "max_queue_wait_s", "must be > 0")
        require(self.events_ttl_s >= 10, "events_ttl_s", "must be >= 10")
        require(self.lease_ttl_s >= 1, "lease_ttl_s", "must be >= 1")
        require(-1 <= self.http_port < 65536, "http_port", "must be -1 (any), 0 (off) or a port")
        require(self.grammar_compile_timeout_s > 0, "grammar_compile_timeout_s", "must be > 0")
        require(self.grammar_threads >= 1, "grammar_threads", "must be >= 1")
        require(1 <= self.max_tenant_streams <= self.max_streams, "max_tenant_streams",
                "must be in 1..max_streams")
        require(self.http_request_timeout_s > 0, "http_request_timeout_s", "must be > 0")
        require(self.max_http_body_bytes > self.max_prompt_bytes, "max_http_body_bytes",
                "must exceed max_prompt_bytes so oversize prompts get a 400 naming the field, not a 413")
        require(self.max_message_bytes > self.max_prompt_bytes, "max_message_bytes",
                "must exceed max_prompt_bytes so oversize prompts get INVALID_ARGUMENT, not a transport error")

    def models_config(self) -> ModelsConfig:
        """The served models and aliases; SettingsError when the list or file cannot be used."""
        try:
            config = from_setting(self.models)
        except ModelsFileError as exc:
            raise SettingsError(f"invalid setting models: {exc}") from None
        require(bool(config.models), "models", "at least one model")
        return config
