"""The live roofline meter: how close each engine step runs to the machine's memory bandwidth.

A decode step reads every weight once and the KV cache of every context it attends over; at small
batches that traffic, not arithmetic, sets its time. So per step

    bytes    = weights in their stored format (GGUF blocks, int8, fp32 ... as loaded)
             + the K and V rows each sequence's query attended over, layer by layer (a windowed
               layer reads at most its window, plus the chunk's own span for a prefill)
    achieved = bytes / the step's wall time                       (GB/s, 1 GB = 1e9 bytes)
    fraction = achieved / the bandwidth the worker probed at start

The probe (`probe_bandwidth`) reads (CPU) or copies device to device (CUDA) a buffer well beyond the
last-level cache a few times and keeps the best. The embedding table is left out (a step gathers
only its own tokens' rows), as are activations and the KV rows a step writes: the figure is the
least a step had to read, so a fraction near 1 means the step cannot run much faster on this memory.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.llama import GEMMS, LlamaModel
from gpu_worker.ops.backend import LinearWeight
from gpu_worker.ops.weights.quantized_linear import QuantizedWeight

logger = structlog.get_logger(__name__)

GB = 1e9
MIN_PROBE_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}
MAX_PROBE_BYTES = 2**30
PROBE_REPEATS = 10
_CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


@dataclass(frozen=True)
class BandwidthProbe:
    """What the start-up probe measured."""

    device: str          # "cpu" or the GPU's name
    kind: str            # "read" (CPU: a sum over the buffer) or "copy" (CUDA: device to device)
    gbps: float          # best of `repeats`; a copy counts its reads and its writes
    buffer_bytes: int
    repeats: int
    seconds: float       # the whole probe, allocation included


@dataclass(frozen=True)
class RooflineStats:
    """The meter's figures (in `EngineStats.roofline`)."""

    weight_bytes: int = 0           # what one step reads of the weights
    last_step_bytes: int = 0        # weights + KV the last step read
    last_step_s: float = 0.0
    total_bytes: int = 0            # over every step so far
    total_step_s: float = 0.0
    probe_gbps: float = 0.0         # 0.0: not probed

    @property
    def achieved_gbps(self) -> float:
        """The last step's bytes over its wall time, GB/s."""
        return self.last_step_bytes / self.last_step_s / GB if self.last_step_s > 0 else 0.0

    @property
    def fraction(self) -> float:
        """The last step's achieved bandwidth over the probe's (0.0 without a probe)."""
        return self.achieved_gbps / self.probe_gbps if self.probe_gbps > 0 else 0.0


# ---- bytes ----------------------------------------------------------------------------------------

def tensor_bytes(weight: LinearWeight | torch.Tensor) -> int:
    """Bytes a weight takes in memory, in whatever form the backend left it."""
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes
    assert isinstance(weight, torch.Tensor), f"no byte count for a {type(weight).__name__}"
    return weight.numel() * weight.element_size()


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of weights one forward reads: every layer's GEMM weights, norms and biases in their
    stored format, the final norm and the vocab head (the embedding table only by its gathered rows,
    which are not counted)."""
    total = tensor_bytes(model.norm) + tensor_bytes(model.lm_head)
    for layer in model.layers:
        total += sum(tensor_bytes(getattr(layer, name)) for name in GEMMS)
        total += sum(tensor_bytes(p) for name, p in layer.named_parameters(recurse=False) if name not in GEMMS)
    return total


@dataclass(frozen=True)
class KVFootprint:
    """How many KV bytes a query span reads: per layer and token, K and V of every kv head."""

    token_layer_bytes: int                       # 2 * num_kv_heads * head_dim * element size
    windows: tuple[tuple[int | None, int], ...]  # (window or None for a full layer, how many layers)

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype) -> KVFootprint:
        elem = torch.empty((), dtype=dtype).element_size()
        layers = Counter(config.layer_window(i) for i in range(config.num_layers))
        return cls(2 * config.num_kv_heads * config.head_dim * elem, tuple(layers.items()))

    def span_bytes(self, start: int, end: int) -> int:
        """Bytes the queries at positions [start, end) read: keys 0..end-1, or on a windowed layer only
        those some query p of the span sees (p - window < k <= p)."""
        tokens = sum(count * (end - max(0, start - window + 1) if window is not None else end)
                     for window, count in self.windows)
        return tokens * self.token_layer_bytes


class RooflineMeter:
    """Counts each step's bytes against its wall time.

    Args:
        weights: bytes of weights a step reads (`weight_bytes`).
        kv: the KV cache's footprint per token (`KVFootprint.of`).
    """

    def __init__(self, weights: int, kv: KVFootprint) -> None:
        self.weights = weights
        self.kv = kv
        self._steps = RooflineStats(weight_bytes=weights)  # written by record() only (the step thread)
        self.probe_gbps = 0.0                               # written by offer_probe() only (any thread)

    @property
    def stats(self) -> RooflineStats:
        return dataclasses.replace(self._steps, probe_gbps=self.probe_gbps)

    @classmethod
    def for_model(cls, model: LlamaModel, kv_cache: KVCache) -> RooflineMeter:
        return cls(weight_bytes(model), KVFootprint.of(model.config, kv_cache.dtype))

    def step_bytes(self, spans: Iterable[tuple[int, int]]) -> int:
        """Weights plus the KV that the query spans [start, end) of one step attended over."""
        return self.weights + sum(self.kv.span_bytes(start, end) for start, end in spans)

    def record(self, nbytes: int, seconds: float) -> None:
        """One step read `nbytes` (`step_bytes`) in `seconds` of wall time."""
        s = self._steps
        self._steps = RooflineStats(s.weight_bytes, nbytes, seconds, s.total_bytes + nbytes, s.total_step_s + seconds)

    def offer_probe(self, probe: BandwidthProbe) -> float:
        """Keep the best probe so far as the fractions' reference (a probe that ran in a busy moment reads
        low, never high); returns it, GB/s."""
        self.probe_gbps = max(self.probe_gbps, probe.gbps)
        return self.probe_gbps

    def reset(self) -> None:
        """Zero the step figures; the probe stays."""
        self._steps = RooflineStats(self.weights)


# ---- the probe ------------------------------------------------------------------------------------

def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (0 where sysfs does not say)."""
    sizes = [0]
    for index in _CPU_CACHES.glob("index*"):
        text = (index / "size").read_text().strip() if (index / "size").exists() else ""
        if text[:-1].isdigit():
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1))
    return max(sizes)


def probe_buffer_bytes(device: torch.device) -> int:
    """Four times the last-level cache (L2 on a GPU), at least MIN_PROBE_BYTES, at most MAX_PROBE_BYTES."""
    if device.type == "cuda":
        cache = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    else:
        cache = last_level_cache_bytes()
    return min(MAX_PROBE_BYTES, max(MIN_PROBE_BYTES[device.type], 4 * cache))


def _cpu_read_seconds(nbytes: int, repeats: int) -> list[float]:
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # [n]; written once, so every page is resident
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return times


def _cuda_copy_seconds(device: torch.device, nbytes: int, repeats: int) -> list[float]:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # [n]
    dst = torch.empty_like(src)
    dst.copy_(src)                                               # first copy: lazy init, not timed
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for begin, end in events:
        begin.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize(device)
    return [begin.elapsed_time(end) / 1e3 for begin, end in events]


def probe_bandwidth(device: torch.device | str, repeats: int = PROBE_REPEATS) -> BandwidthProbe:
    """Measure the memory bandwidth of `device` (CPU: reads with torch's threads; CUDA: device-to-device
    copies timed by CUDA events, reads and writes both counted) and log it in one line."""
    device = torch.device(device)
    start = time.perf_counter()
    nbytes = probe_buffer_bytes(device)
    if device.type == "cuda":
        moved, seconds = 2 * nbytes, _cuda_copy_seconds(device, nbytes, repeats)
        probe_kind, name = "copy", torch.cuda.get_device_name(device)
    else:
        moved, seconds = nbytes, _cpu_read_seconds(nbytes, repeats)
        probe_kind, name = "read", "cpu"
    probe = BandwidthProbe(name, probe_kind, moved / min(seconds) / GB, nbytes, repeats, time.perf_counter() - start)
    logger.info("memory bandwidth probed", device=probe.device, kind=probe.kind, gbps=round(probe.gbps, 2),
                buffer_mib=round(nbytes / 2**20, 1), repeats=repeats, seconds=round(probe.seconds, 3))
    return probe
