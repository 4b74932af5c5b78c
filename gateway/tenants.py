"""Tenants file: who may call, with which limits. Keys are stored as sha256 hex only.

    tenants:
      - id: acme
        api_keys: ["sha256:<hex>"]
        requests_per_second: 5
        burst: 10
        tokens_per_minute: 20000
        max_concurrent: 4
        max_new_tokens: 512
        priority: normal
        models: ["*"]            # aliases or concrete ids NAME@VERSION; a NAME allows all its versions
        cache_group: ""          # optional: tenants of one group share prefix-cache hits
        raw_special_tokens: false   # optional: special tokens spelled in `prompt` act as control tokens
        weight: 1                # optional: share of tokens when tenants compete (batcher/fair_queue.py)
        slo_ttft_ms: 0           # optional defaults of requests that set no target (0 = none; llmserve/protocol/slo.py)
        slo_tpot_ms: 0
        shed_unmeetable: false   # optional: refuse early a request whose TTFT target can no longer be met

Prefix-cache isolation: every work item carries the tenant's `cache_salt`, which
enters the KV block hash chain. Without a cache_group each tenant has a salt of its
own, so no tenant can hit (and, through `usage.cached_prompt_tokens` or timing,
detect) blocks another tenant computed; tenants naming the same cache_group share
one salt, hence each other's cached prompts.

Special tokens spelled in chat messages are always encoded as text; in a raw
`prompt` too, unless the tenant has `raw_special_tokens: true` (a tenant that
builds its own prompts with the model's control tokens).

`TenantRegistry.reload()` swaps the whole table at once (SIGHUP); requests in
flight keep the `Tenant` they were admitted with.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
import yaml

from llmserve.protocol.slo import Targets
from llmserve.runtime.errors import Unauthenticated
from llmserve.v1 import inference_pb2 as pb

logger = structlog.get_logger(__name__)

PRIORITIES = {"low": pb.PRIORITY_LOW, "normal": pb.PRIORITY_NORMAL, "high": pb.PRIORITY_HIGH}
MAX_SLO_MS = 3_600_000   # a latency target above an hour is a typo, not a target


class TenantsError(ValueError):
    """The tenants file cannot be used."""


@dataclass(frozen=True)
class Tenant:
    id: str
    key_hashes: tuple[str, ...]
    requests_per_second: float
    burst: int
    tokens_per_minute: int
    max_concurrent: int
    max_new_tokens: int
    priority: int
    models: tuple[str, ...]
    cache_group: str = ""
    raw_special_tokens: bool = False
    weight: float = 1.0
    slo: Targets = Targets()          # defaults of requests that set no target
    shed_unmeetable: bool = False     # refuse early what cannot meet its TTFT target (gateway/shedding.py)

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of this tenant's requests: its cache_group's, else its own."""
        return f"group:{self.cache_group}" if self.cache_group else f"tenant:{self.id}"

    def may_use(self, model: str) -> bool:
        """`*`, the name itself, or, for a concrete `NAME@VERSION`, its NAME: listing a model's
        name (the usual alias) allows every version of it; listing `NAME@v1` allows only v1."""
        return "*" in self.models or model in self.models or model.partition("@")[0] in self.models


def hash_key(api_key: str) -> str:
    """The stored form of an API key: sha256 hex of its UTF-8 bytes."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def _key_hash(entry: str, tenant_id: str) -> str:
    if not isinstance(entry, str) or not entry.startswith("sha256:") or len(entry) != 7 + 64:
        raise TenantsError(f"tenant {tenant_id}: api_keys entries must be 'sha256:<64 hex>'")
    return entry[7:].lower()


def _positive(raw: dict, name: str, tenant_id: str, kind: type = int):
    value = raw.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise TenantsError(f"tenant {tenant_id}: {name} must be a positive number")
    return kind(value)


def parse_tenant(raw: dict) -> Tenant:
    tenant_id = str(raw.get("id") or "")
    if not tenant_id or any(c in tenant_id for c in "{}: "):
        raise TenantsError(f"tenant id {tenant_id!r} must be non-empty without braces, colons or spaces")
    priority = str(raw.get("priority", "normal")).lower()
    if priority not in PRIORITIES:
        raise TenantsError(f"tenant {tenant_id}: priority must be low, normal or high")
    return Tenant(
        id=tenant_id,
        key_hashes=tuple(_key_hash(k, tenant_id) for k in raw.get("api_keys") or []),
        requests_per_second=_positive(raw, "requests_per_second", tenant_id, float),
        burst=_positive(raw, "burst", tenant_id),
        tokens_per_minute=_positive(raw, "tokens_per_minute", tenant_id),
        max_concurrent=_positive(raw, "max_concurrent", tenant_id),
        max_new_tokens=_positive(raw, "max_new_tokens", tenant_id),
        priority=PRIORITIES[priority],
        models=tuple(str(m) for m in raw.get("models") or ["*"]),
        cache_group=_cache_group(raw, tenant_id),
        raw_special_tokens=_flag(raw, "raw_special_tokens", tenant_id),
        weight=_positive({"weight": 1, **raw}, "weight", tenant_id, float),
        slo=Targets(_slo_ms(raw, "slo_ttft_ms", tenant_id), _slo_ms(raw, "slo_tpot_ms", tenant_id)),
        shed_unmeetable=_flag(raw, "shed_unmeetable", tenant_id),
    )


def _slo_ms(raw: dict, name: str, tenant_id: str) -> int:
    value = raw.get(name, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SLO_MS:
        raise TenantsError(f"tenant {tenant_id}: {name} must be an integer 0..{MAX_SLO_MS} (0 = no target)")
    return value


def _flag(raw: dict, name: str, tenant_id: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise TenantsError(f"tenant {tenant_id}: {name} must be true or false")
    return value


def _cache_group(raw: dict, tenant_id: str) -> str:
    group = raw.get("cache_group") or ""
    if not isinstance(group, str):
        raise TenantsError(f"tenant {tenant_id}: cache_group must be a string")
    return group


def parse_tenants(text: str) -> dict[str, Tenant]:
    """key hash → Tenant, from the YAML text of a tenants file."""
    doc = yaml.safe_load(text) or {}
    by_hash: dict[str, Tenant] = {}
    ids: set[str] = set()
    for raw in doc.get("tenants") or []:
        tenant = parse_tenant(raw)
        if tenant.id in ids:
            raise TenantsError(f"tenant {tenant.id} listed twice")
        ids.add(tenant.id)
        for key_hash in tenant.key_hashes:
            if key_hash in by_hash:
                raise TenantsError(f"an api key is listed for both {by_hash[key_hash].id} and {tenant.id}")
            by_hash[key_hash] = tenant
    return by_hash


class TenantRegistry:
    """The current tenants table; `authenticate()` maps an API key to its tenant."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._by_hash: dict[str, Tenant] = {}

    def load(self) -> TenantRegistry:
        self._by_hash = parse_tenants(self.path.read_text())
        logger.info("tenants loaded", path=str(self.path), tenants=len(self.tenant_ids()))
        return self

    def reload(self) -> bool:
        """Re-read the file; on any error keep the current table (and say why)."""
        try:
            self.load()
            return True
        except (OSError, yaml.YAMLError, TenantsError) as exc:
            logger.error("tenants reload failed; keeping the previous table", error=str(exc))
            return False

    def tenant_ids(self) -> set[str]:
        return {t.id for t in self._by_hash.values()}

    def authenticate(self, metadata: Mapping[str, str]) -> Tenant:
        """The tenant of `authorization: Bearer <key>`; UNAUTHENTICATED otherwise."""
        header = metadata.get("authorization", "")
        scheme, _, api_key = header.partition(" ")
        if scheme.lower() != "bearer" or not api_key.strip():
            raise Unauthenticated("missing bearer api key (metadata authorization: Bearer <key>)")
        digest = hash_key(api_key.strip())
        tenant = self._by_hash.get(digest)
        # The dict lookup finds the candidate; compare_digest keeps the final check constant-time.
        stored = next((h for h in tenant.key_hashes if hmac.compare_digest(h, digest)), None) if tenant else None
        if tenant is None or stored is None:
            raise Unauthenticated("unknown api key")
        return tenant
