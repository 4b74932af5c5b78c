"""WorkerSettings: the one typed settings object of `python -m gpu_worker`."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from llmserve.runtime.settings import CommonSettings, require, setting

DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_FORMATS = ("none", "int8", "int4")  # CPU weight formats: gpu_worker/ops/weights/quantized_linear.py
QUANTIZATIONS = ("auto", *WEIGHT_FORMATS)  # --quantization


@dataclass
class WorkerSettings(CommonSettings):
    model: str = setting("smollm2-135m", "model alias, GGUF file or Hugging Face directory")
    device: str = setting("auto", "auto, cpu or cuda (auto: cuda when a GPU and CuPy are there)")
    dtype: str = setting("auto", "compute dtype: auto, float32, bfloat16 or float16")
    # auto = int4 on CPU where the block kernel builds: Q4_1 blocks with 16-bit activation codes keep
    # fp32's greedy tokens (bench/quality.py) and decode faster than fp32 at every batch size
    # (docs/performance.md); fp32 elsewhere and on CUDA
    quantization: str = setting("auto", "weight format of the GEMMs: auto (int4 on CPU where the model's widths "
                                        "and the C kernel allow, else none), none (the model dtype), int8 "
                                        "(per-channel; CPU and CUDA) or int4 (groups of 32, the GGUF Q4_1 "
                                        "layout; CPU); weight-only")
    worker_id: str = setting("", "id in the workers hash and inbox stream name (default host-pid)")
    block_size: int = setting(16, "tokens per KV-cache block")
    kv_cache_mb: int = setting(512, "KV-cache memory budget in MiB (sets the number of blocks)")
    num_blocks: int = setting(0, "KV-cache blocks; overrides kv_cache_mb when > 0")
    max_running: int = setting(32, "sequences running at once")
    max_batched_tokens: int = setting(512, "tokens per forward step (decodes + prefill chunks)")
    prefix_caching: bool = setting(True, "reuse KV of shared prompt prefixes")
    priority_preemption: bool = setting(True, "a HIGH request that finds the worker full preempts the lowest-"
                                              "priority, newest running sequences (gpu_worker/engine/scheduler.py)")
    fair_share: str = setting("tokens", "what tenants share fairly in admission: tokens (VTC, prompt and "
                                        "generated, over the tenant's weight) or requests (round-robin)")
    aging_steps: int = setting(256, "starvation guard: engine steps waited per priority level gained; a LOW "
                                    "sequence with nothing older ahead waits at most 2x this + 1 steps")
    # auto is on where it was measured to win (docs/performance.md): one running sequence, 2 CPU threads,
    # SmolLM2 Q4_1, 64 tokens after a chat prompt: greedy 83 -> 150 tok/s, temperature 0.7 85 -> 103,
    # temperature 1 the same (drafts rarely match); at 2 running sequences 3 drafted tokens already
    # lose (166 -> 135 tok/s). Unmeasured on CUDA, where a decode step replays a CUDA graph and a
    # drafted step runs eagerly: off there unless set.
    spec_tokens: int = setting(-1, "prompt-lookup speculative decoding: tokens drafted from the context a "
                                   "step at most (0 = off, -1 = auto: 3 on CPU, 0 on CUDA); output is the "
                                   "same token for token either way (gpu_worker/engine/speculation.py)")
    spec_max_running: int = setting(1, "draft only while at most this many sequences run (drafts pay where a "
                                       "step's time is weight reads)")
    # through the stack (llmserve up, one openai client streaming 256 tokens, 6 requests each, Intel
    # Xeon VM): at temperature 1 drafts cost 7 % (122.7 tok/s against 131.7 with spec_tokens 0), at
    # 0.7 they still paid (114.6 against 109.7)
    spec_max_temperature: float = setting(0.7, "draft only for sequences sampled at most this hot (greedy is 0; "
                                               "hotter draws rarely match a draft)")
    heartbeat_s: float = setting(0.5, "seconds between heartbeats")
    heartbeat_give_up_s: float = setting(30.0, "seconds heartbeats may fail in a row (Redis down, OOM, READONLY) "
                                               "before the worker fails (exit 1) for its supervisor to replace it")
    step_timeout_s: float = setting(60.0, "an engine step running longer fails the worker (health NOT_SERVING, "
                                          "heartbeat deleted so its inbox is reclaimed, exit 1)")
    events_ttl_s: int = setting(3600, "seconds token-event streams live after their last event")
    drain_timeout_s: float = setting(30.0, "seconds running sequences may finish on drain before handoff")
    max_inbox_batches: int = setting(4, "inbox entries read per poll")
    warmup: bool = setting(True, "run one forward before reporting SERVING")
    bandwidth_probe: bool = setting(True, "measure memory bandwidth at start (well under a second), the "
                                          "reference of the roofline meter's fractions (gpu_worker/roofline.py)")
    torch_threads: int = setting(0, "CPU threads for torch ops (0 = torch's default)")
    cuda_graph_batch_sizes: str = setting("1,2,4,8,16,32,64",
                                          "decode batch sizes captured in CUDA graphs on cuda ('' = off)")

    def validate(self) -> None:
        super().validate()
        require(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
        require(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        require(self.quantization in QUANTIZATIONS, "quantization", f"must be one of {', '.join(QUANTIZATIONS)}")
        require(self.block_size in (8, 16, 32, 64), "block_size", "must be 8, 16, 32 or 64")
        require(self.kv_cache_mb > 0, "kv_cache_mb", "must be > 0")
        require(self.num_blocks >= 0, "num_blocks", "must be >= 0")
        require(self.max_running >= 1, "max_running", "must be >= 1")
        require(self.aging_steps >= 1, "aging_steps", "must be >= 1")
        require(self.fair_share in ("tokens", "requests"), "fair_share", "must be tokens or requests")
        require(self.max_batched_tokens >= self.max_running, "max_batched_tokens",
                "must be >= max_running (every running sequence decodes one token per step)")
        require(-1 <= self.spec_tokens <= 16, "spec_tokens", "must be -1 (auto) or 0 to 16")
        require(self.spec_max_running >= 1, "spec_max_running", "must be >= 1")
        require(self.spec_max_temperature >= 0, "spec_max_temperature", "must be >= 0")
        require(self.heartbeat_s > 0, "heartbeat_s", "must be > 0")
        require(self.heartbeat_give_up_s >= self.heartbeat_s, "heartbeat_give_up_s", "must be >= heartbeat_s")
        require(self.step_timeout_s > 0, "step_timeout_s", "must be > 0")
        require(self.events_ttl_s > 0, "events_ttl_s", "must be > 0")
        require(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")
        require(self.torch_threads >= 0, "torch_threads", "must be >= 0")
        require(self.max_inbox_batches >= 1, "max_inbox_batches", "must be >= 1")
        require(all(part.strip().isdigit() and int(part) > 0 for part in self.cuda_graph_batch_sizes.split(",")
                    if part.strip()), "cuda_graph_batch_sizes", "must be a comma list of positive integers")
        require(not self.worker_id or ("{" not in self.worker_id and "}" not in self.worker_id),
                "worker_id", "must not contain braces (they are Redis hash tags)")

    def draft_tokens(self, device: str) -> int:
        """spec_tokens with auto resolved for the worker's device ("cpu" or "cuda")."""
        if self.spec_tokens >= 0:
            return self.spec_tokens
        return 3 if device == "cpu" else 0

    def graph_batch_sizes(self) -> list[int]:
        return [int(part) for part in self.cuda_graph_batch_sizes.split(",") if part.strip()]

    def admin_address(self) -> str:
        """host:port other services reach the admin API at (a wildcard bind is no address)."""
        host = self.host if self.host not in ("0.0.0.0", "::", "") else socket.gethostbyname(socket.gethostname())
        return f"{host}:{self.port}"

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"
