"""Settings of tokenizer_svc (flags, env LLMSERVE_*, defaults; validated once at start-up)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from llmserve.catalog.models_file import ModelsFileError, from_setting
from llmserve.runtime.settings import CommonSettings, SettingsError, require, setting


@dataclass
class TokenizerSettings(CommonSettings):
    models: str = setting("smollm2-135m", "comma list of model specs (alias, path or ID=PATH; the first is the "
                                          "default), or @FILE: a models file (llmserve/catalog/models_file.py)")
    workers: int = setting(0, "pool processes (0 = one per CPU core)")
    max_text_bytes: int = setting(1 << 20, "largest text (or all message contents together) per request, bytes")
    max_messages: int = setting(512, "most chat messages per request")
    max_batch_requests: int = setting(256, "most requests in one EncodeBatch")
    max_decode_ids: int = setting(1 << 18, "most token ids in one Decode")
    long_text_bytes: int = setting(8192, "inputs above this many bytes run on each process's bulk lane, so "
                                         "short requests never queue behind them")
    cache_bytes: int = setting(64 << 20, "LRU cache of recent encodings, bytes (0 = off)")
    segment_cache_bytes: int = setting(16 << 20, "per pool process: encoded chat segments (text between special "
                                                 "tokens: system prompts, earlier turns) kept, bytes (0 = off)")
    request_timeout_s: float = setting(30.0, "deadline of a request that carries none")
    max_message_bytes: int = setting(16 << 20, "largest gRPC message sent or received")

    def validate(self) -> None:
        super().validate()
        require(bool(self.model_specs()), "models", "must name at least one model")
        require(0 <= self.workers <= 256, "workers", "must be in 0..256")
        require(self.max_text_bytes >= 1, "max_text_bytes", "must be >= 1")
        require(self.max_messages >= 1, "max_messages", "must be >= 1")
        require(self.max_batch_requests >= 1, "max_batch_requests", "must be >= 1")
        require(self.max_decode_ids >= 1, "max_decode_ids", "must be >= 1")
        require(self.long_text_bytes >= 1, "long_text_bytes", "must be >= 1")
        require(self.cache_bytes >= 0, "cache_bytes", "must be >= 0")
        require(self.segment_cache_bytes >= 0, "segment_cache_bytes", "must be >= 0")
        require(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        require(self.max_message_bytes >= self.max_text_bytes + 4096, "max_message_bytes",
                "must exceed max_text_bytes")

    def model_specs(self) -> list[str]:
        try:
            return from_setting(self.models).specs()
        except ModelsFileError as exc:
            raise SettingsError(f"invalid setting models: {exc}") from None

    def pool_size(self) -> int:
        return self.workers or os.cpu_count() or 1
