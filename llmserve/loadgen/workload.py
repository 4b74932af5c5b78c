"""What the load generator sends: length distributions, prompts, tenants, arrival times.

Everything here is pure and seeded, so a workload can be rebuilt exactly and
unit-tested without a server.

    specs = build_workload(WorkloadConfig(requests=100, prompt_tokens=parse_dist("uniform:16:128"),
                                          output_tokens=parse_dist("64"), api_keys=["k1", "k2"], seed=7))
    offsets = poisson_arrivals(rate=4.0, count=100, rng=random.Random(7))
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

# Short, common English words: roughly one BPE token each, so a prompt of N words
# is close to N prompt tokens for Llama-family tokenizers.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part"
).split()


class DistError(ValueError):
    """A length distribution spec cannot be parsed."""


@dataclass(frozen=True)
class LengthDist:
    """A distribution of positive integer lengths (tokens).

    Spec forms (see `parse_dist`): "64" (constant), "uniform:LO:HI" (inclusive),
    "normal:MEAN:STD" and "exp:MEAN" (both rounded and clamped to [1, 1e6]).
    """

    kind: str
    params: tuple[float, ...]

    def sample(self, rng: random.Random) -> int:
        return _clamp(_SAMPLERS[self.kind](rng, *self.params))

    def mean(self) -> float:
        return _MEANS[self.kind](*self.params)


def _clamp(value: float) -> int:
    return int(min(max(round(value), 1), 1_000_000))


_SAMPLERS: dict[str, Callable[..., float]] = {
    "const": lambda rng, n: n,
    "uniform": lambda rng, lo, hi: rng.randint(int(lo), int(hi)),
    "normal": lambda rng, mean, std: rng.gauss(mean, std),
    "exp": lambda rng, mean: rng.expovariate(1.0 / mean),
}
_MEANS: dict[str, Callable[..., float]] = {
    "const": lambda n: n,
    "uniform": lambda lo, hi: (lo + hi) / 2,
    "normal": lambda mean, std: mean,
    "exp": lambda mean: mean,
}
_ARITY = {"const": 1, "uniform": 2, "normal": 2, "exp": 1}


def parse_dist(spec: str) -> LengthDist:
    """Parse "64", "const:64", "uniform:16:128", "normal:64:16" or "exp:64"."""
    parts = spec.strip().split(":")
    kind, raw = ("const", parts) if len(parts) == 1 else (parts[0].lower(), parts[1:])
    if kind not in _ARITY or len(raw) != _ARITY[kind]:
        raise DistError(f"bad length distribution {spec!r}: use N, uniform:LO:HI, normal:MEAN:STD or exp:MEAN")
    try:
        params = tuple(float(p) for p in raw)
    except ValueError:
        raise DistError(f"bad length distribution {spec!r}: parameters must be numbers") from None
    if not all(math.isfinite(p) for p in params) or params[0] < 1 or (kind == "uniform" and params[1] < params[0]) \
            or (kind == "normal" and params[1] < 0):
        raise DistError(f"bad length distribution {spec!r}: lengths must be >= 1 (and LO <= HI, STD >= 0)")
    return LengthDist(kind, params)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload."""

    seq: int                 # position in the workload, 0-based
    api_key: str
    tenant: int              # index of api_key in WorkloadConfig.api_keys
    prompt: str
    prompt_words: int
    max_new_tokens: int
    seed: int


@dataclass
class WorkloadConfig:
    requests: int
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    api_keys: list[str] = field(default_factory=lambda: ["dev-key"])
    tenant_weights: list[float] | None = None   # None: equal shares
    seed: int = 0


def make_prompt(words: int, rng: random.Random) -> str:
    """A prompt of `words` random common words (≈ that many tokens)."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workload_stream(config: WorkloadConfig) -> Iterator[RequestSpec]:
    """An endless seeded stream of requests (config.requests is ignored); for time-bounded runs."""
    rng = random.Random(config.seed)
    weights = config.tenant_weights or [1.0] * len(config.api_keys)
    if len(weights) != len(config.api_keys):
        raise ValueError("tenant_weights must have one weight per api key")
    for seq in itertools.count():
        tenant = rng.choices(range(len(config.api_keys)), weights=weights)[0]
        words = config.prompt_tokens.sample(rng)
        yield RequestSpec(seq=seq, api_key=config.api_keys[tenant], tenant=tenant,
                          prompt=make_prompt(words, rng), prompt_words=words,
                          max_new_tokens=config.output_tokens.sample(rng), seed=rng.getrandbits(32))


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    """The seeded list of config.requests requests: same config, same requests."""
    return list(itertools.islice(workload_stream(config), config.requests))


def poisson_arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """Send times (seconds from start) of a Poisson process: exponential gaps of mean 1/rate."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times
