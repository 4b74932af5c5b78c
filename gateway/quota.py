"""Per-tenant quotas in Redis, one Lua script round trip per admission.

Three limits, all keys under the tenant's hash tag `{t:<tenant>}`:

    rate      GCRA: string TAT (theoretical arrival time, ms). Emission interval
              T = 1000 / requests_per_second; a request is admitted iff
              max(TAT, now) + T - now <= burst * T, so at most `burst` at once and
              `requests_per_second` sustained.
    tokens    token bucket (hash level, ts) of capacity tokens_per_minute refilled
              continuously; admission reserves prompt + max_new_tokens, release
              refunds reserved - used.
    leases    zset request_id -> expiry ms; at most max_concurrent unexpired
              members; renewed while a request runs, so a crashed gateway's
              leases lapse after lease_ttl.
    reserved  hash request_id -> tokens reserved (refund at most once)
    ledger    hash reserved / refunded totals (accounting, metrics, tests)

No limit is charged unless every limit admits. Time is Redis `TIME`, so all
gateways share one clock.

A request is admitted in two steps, so nothing costly runs for a request its tenant may not
make: `admit` with cost 0 (rate + lease) before any tokenizing or grammar compile, then
`reserve` the tokens once they are counted (a refusal there keeps the rate charge, as a
failed compile does: the gateway did work for it). One step (`admit` with the cost) stays
for callers that know the cost up front.

Besides whole requests (`admit`): a Tokenize call is charged against the rate only
(`charge_request`), and a stream viewer that re-attaches to a request takes a lease of
its own (`lease`, no tokens) unless it carries on the request's, so resumes count
against max_concurrent like the requests they watch.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.protocol import keys
from llmserve.runtime import redis_client

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
"""

_BUCKET = """
local function bucket_level(key, cap, now)
  local b = redis.call('HMGET', key, 'level', 'ts')
  local level = tonumber(b[1]) or cap
  local ts = tonumber(b[2]) or now
  return math.min(cap, level + math.max(0, now - ts) * cap / 60000)
end
"""

_EXPIRE_LEASES = """
local function expire_leases(leases, reserved, now)
  local gone = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  for _, rid in ipairs(gone) do
    redis.call('ZREM', leases, rid)
    redis.call('HDEL', reserved, rid)
  end
end
"""

# KEYS: rate tokens leases reserved ledger
# ARGV: interval_ms burst tokens_per_minute max_concurrent cost request_id lease_ttl_ms concurrency_retry_ms
ADMIT = _NOW + _BUCKET + _EXPIRE_LEASES + """
local T, burst, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local maxc, cost, rid = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local ttl, cretry = tonumber(ARGV[7]), tonumber(ARGV[8])
expire_leases(KEYS[3], KEYS[4], now)
if redis.call('ZSCORE', KEYS[3], rid) then
  return {0, 'duplicate', 0, 0, 0}
end
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or now), now)
local new_tat = tat + T
local level = bucket_level(KEYS[2], cap, now)
local remaining_tokens = math.floor(level)
local rate_wait = new_tat - burst * T - now
if rate_wait > 0 then
  return {0, 'requests_per_second', math.ceil(rate_wait), 0, remaining_tokens}
end
local remaining_requests = math.floor((burst * T - (new_tat - now)) / T + 1e-9)
if redis.call('ZCARD', KEYS[3]) >= maxc then
  return {0, 'max_concurrent', cretry, remaining_requests, remaining_tokens}
end
if cost > level then
  return {0, 'tokens_per_minute', math.ceil((cost - level) * 60000 / cap), remaining_requests, remaining_tokens}
end
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now) + 1000)
redis.call('HSET', KEYS[2], 'level', tostring(level - cost), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[2], 120000)
redis.call('ZADD', KEYS[3], now + ttl, rid)
redis.call('PEXPIRE', KEYS[3], ttl * 2)
redis.call('HSET', KEYS[4], rid, cost)
redis.call('PEXPIRE', KEYS[4], ttl * 2)
redis.call('HINCRBY', KEYS[5], 'reserved', cost)
return {1, '', 0, remaining_requests, math.floor(level - cost)}
"""

# KEYS: tokens reserved ledger   ARGV: request_id cost tokens_per_minute
# The tokens of a request `admit` let in with cost 0 (its reservation is there, at 0).
RESERVE = _NOW + _BUCKET + """
local rid, cost, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('HEXISTS', KEYS[2], rid) == 0 then
  return {0, 'lease_expired', 0, 0}
end
local level = bucket_level(KEYS[1], cap, now)
if cost > level then
  return {0, 'tokens_per_minute', math.ceil((cost - level) * 60000 / cap), math.floor(level)}
end
redis.call('HSET', KEYS[1], 'level', tostring(level - cost), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000)
redis.call('HINCRBY', KEYS[2], rid, cost)
redis.call('HINCRBY', KEYS[3], 'reserved', cost)
return {1, '', 0, math.floor(level - cost)}
"""

# KEYS: rate   ARGV: interval_ms burst
CHARGE_REQUEST = _NOW + """
local T, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or now), now)
local new_tat = tat + T
local rate_wait = new_tat - burst * T - now
if rate_wait > 0 then
  return {0, math.ceil(rate_wait), 0}
end
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now) + 1000)
return {1, 0, math.floor((burst * T - (new_tat - now)) / T + 1e-9)}
"""

# KEYS: leases reserved   ARGV: max_concurrent lease_id lease_ttl_ms concurrency_retry_ms
LEASE = _NOW + _EXPIRE_LEASES + """
local maxc, lid, ttl, cretry = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
expire_leases(KEYS[1], KEYS[2], now)
if redis.call('ZCARD', KEYS[1]) >= maxc then
  return {0, cretry}
end
redis.call('ZADD', KEYS[1], now + ttl, lid)
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return {1, 0}
"""

# KEYS: tokens leases reserved ledger   ARGV: request_id used_tokens tokens_per_minute
RELEASE = _NOW + _BUCKET + """
local rid, used, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREM', KEYS[2], rid)
local cost = tonumber(redis.call('HGET', KEYS[3], rid))
if not cost then
  return -1
end
redis.call('HDEL', KEYS[3], rid)
local refund = math.max(0, cost - used)
local level = math.min(cap, bucket_level(KEYS[1], cap, now) + refund)
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000)
redis.call('HINCRBY', KEYS[4], 'refunded', refund)
return refund
"""

# KEYS: leases reserved   ARGV: request_id lease_ttl_ms
RENEW = _NOW + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]) * 2)
return 1
"""

# KEYS: rate tokens   ARGV: interval_ms burst tokens_per_minute
PEEK = _NOW + _BUCKET + """
local T, burst, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or now), now)
local remaining_requests = math.max(0, math.floor((burst * T - (tat - now)) / T + 1e-9))
return {remaining_requests, math.floor(bucket_level(KEYS[2], cap, now))}
"""


@dataclass(frozen=True)
class Limits:
    """The quota numbers of one tenant (from the tenants file)."""

    tenant: str
    requests_per_second: float
    burst: int
    tokens_per_minute: int
    max_concurrent: int

    @property
    def interval_ms(self) -> float:
        return 1000.0 / self.requests_per_second


@dataclass(frozen=True)
class Decision:
    """What admission said; `limit` names the limit that refused (empty when admitted)."""

    admitted: bool
    limit: str
    retry_after_ms: int
    remaining_requests: int
    remaining_tokens: int


def tenant_keys(tenant: str) -> dict[str, str]:
    return {what: keys.tenant_key(tenant, what) for what in ("rate", "tokens", "leases", "reserved", "ledger")}


class Quota:
    """Admission (`admit`), lease upkeep (`renew`) and refunds (`release`) against Redis."""

    def __init__(self, redis: redis_client.AnyRedis, lease_ttl_s: float = 30.0, concurrency_retry_ms: int = 200) -> None:
        self.redis = redis
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.concurrency_retry_ms = concurrency_retry_ms
        self._admit = redis.register_script(ADMIT)
        self._release = redis.register_script(RELEASE)
        self._renew = redis.register_script(RENEW)
        self._peek = redis.register_script(PEEK)
        self._charge_request = redis.register_script(CHARGE_REQUEST)
        self._reserve = redis.register_script(RESERVE)
        self._lease = redis.register_script(LEASE)

    async def admit(self, limits: Limits, request_id: str, cost_tokens: int) -> Decision:
        """Charge one request and `cost_tokens` tokens and take a lease, or refuse with the limit hit."""
        k = tenant_keys(limits.tenant)
        args: list[str | int] = [repr(limits.interval_ms), limits.burst, limits.tokens_per_minute, limits.max_concurrent,
                int(cost_tokens), request_id, self.lease_ttl_ms, self.concurrency_retry_ms]
        ok, limit, retry, rem_req, rem_tok = await self._admit(
            keys=[k["rate"], k["tokens"], k["leases"], k["reserved"], k["ledger"]], args=args)
        limit = limit.decode() if isinstance(limit, bytes) else str(limit)
        return Decision(bool(ok), limit, int(retry), max(0, int(rem_req)), max(0, int(rem_tok)))

    async def reserve(self, limits: Limits, request_id: str, cost_tokens: int) -> Decision:
        """Reserve the tokens of a request admitted with cost 0, or refuse with tokens_per_minute
        (lease_expired: its lease lapsed meanwhile). Refunded by `release`, as admitted tokens are."""
        k = tenant_keys(limits.tenant)
        ok, limit, retry, rem_tok = await self._reserve(keys=[k["tokens"], k["reserved"], k["ledger"]],
                                                        args=[request_id, int(cost_tokens), limits.tokens_per_minute])
        limit = limit.decode() if isinstance(limit, bytes) else str(limit)
        return Decision(bool(ok), limit, int(retry), 0, max(0, int(rem_tok)))

    async def charge_request(self, limits: Limits) -> Decision:
        """Charge one request against the rate only (no tokens, no lease): a Tokenize call."""
        ok, retry, rem_req = await self._charge_request(keys=[tenant_keys(limits.tenant)["rate"]],
                                                        args=[repr(limits.interval_ms), limits.burst])
        return Decision(bool(ok), "" if ok else "requests_per_second", int(retry), max(0, int(rem_req)), 0)

    async def lease(self, limits: Limits, lease_id: str) -> Decision:
        """Take a concurrency lease under `lease_id` (renew with `renew`, give back with `drop_lease`),
        or refuse with limit max_concurrent."""
        k = tenant_keys(limits.tenant)
        ok, retry = await self._lease(keys=[k["leases"], k["reserved"]],
                                      args=[limits.max_concurrent, lease_id, self.lease_ttl_ms,
                                            self.concurrency_retry_ms])
        return Decision(bool(ok), "" if ok else "max_concurrent", int(retry), 0, 0)

    async def holds(self, tenant: str, lease_id: str) -> bool:
        """Whether the lease `lease_id` is held (an expired one may count until the next admission)."""
        return await self.redis.zscore(tenant_keys(tenant)["leases"], lease_id) is not None

    async def drop_lease(self, tenant: str, lease_id: str) -> None:
        await self.redis.zrem(tenant_keys(tenant)["leases"], lease_id)

    async def release(self, limits: Limits, request_id: str, used_tokens: int) -> int:
        """Drop the lease and refund reserved - used tokens; -1 when already released (idempotent)."""
        k = tenant_keys(limits.tenant)
        return int(await self._release(keys=[k["tokens"], k["leases"], k["reserved"], k["ledger"]],
                                       args=[request_id, int(used_tokens), limits.tokens_per_minute]))

    async def renew(self, tenant: str, request_id: str) -> bool:
        """Push the lease's expiry out by lease_ttl; False when the lease is gone."""
        k = tenant_keys(tenant)
        return bool(await self._renew(keys=[k["leases"], k["reserved"]], args=[request_id, self.lease_ttl_ms]))

    async def peek(self, limits: Limits) -> tuple[int, int]:
        """(remaining requests, remaining tokens) right now, charging nothing."""
        k = tenant_keys(limits.tenant)
        rem_req, rem_tok = await self._peek(keys=[k["rate"], k["tokens"]],
                                            args=[repr(limits.interval_ms), limits.burst, limits.tokens_per_minute])
        return int(rem_req), int(rem_tok)

    async def in_flight(self, tenant: str) -> int:
        return int(await self.redis.zcard(tenant_keys(tenant)["leases"]))

    async def ledger(self, tenant: str) -> tuple[int, int]:
        """(tokens reserved, tokens refunded) since the ledger began."""
        reserved, refunded = await self.redis.hmget(tenant_keys(tenant)["ledger"], "reserved", "refunded")
        return int(reserved or 0), int(refunded or 0)
