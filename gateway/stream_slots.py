"""What an attached stream holds besides its request: a slot among this gateway's
streams of its tenant and, for a viewer that re-attached, a concurrency lease of its own.

    TenantStreams  open Generate/Complete streams per tenant in this process; at
                   max_tenant_streams the next one is RESOURCE_EXHAUSTED, so one tenant
                   cannot take every stream reader of a gateway (max_streams)
    ViewerLease    a re-attached viewer that does not carry on the request's own lease
                   (another viewer is attached, or the request already finished and gave
                   its lease back) holds one of its own while attached: resumes count
                   against max_concurrent
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.calls import rejection
from gateway.quota import Decision, Limits, Quota


class TenantStreams:
    """Per-tenant count of this gateway's open streams, capped.

    Args:
        cap: most streams one tenant may have open on this gateway.
        retry_after_ms: the retry hint when the cap is reached.
    """

    def __init__(self, cap: int, retry_after_ms: int) -> None:
        self.cap = cap
        self.retry_after_ms = retry_after_ms
        self.open: Counter[str] = Counter()

    @contextmanager
    def slot(self, tenant: str) -> Iterator[None]:
        """Hold one of the tenant's stream slots for the duration of the block."""
        if self.open[tenant] >= self.cap:
            refused = Decision(False, "max_tenant_streams", self.retry_after_ms, 0, 0)
            raise rejection(tenant, refused, f" ({self.cap} open streams of this tenant on this gateway)")
        self.open[tenant] += 1
        try:
            yield
        finally:
            self.open[tenant] -= 1
            if not self.open[tenant]:
                del self.open[tenant]


class ViewerLease:
    """The concurrency lease of one re-attached viewer; renewed while it streams."""

    def __init__(self, quota: Quota, tenant: str, lease_id: str, renew_every_s: float) -> None:
        self.quota = quota
        self.tenant = tenant
        self.lease_id = lease_id
        self.renew_every_s = renew_every_s
        self.next_renew_s = time.monotonic() + renew_every_s

    @classmethod
    async def take(cls, quota: Quota, limits: Limits, request_id: str, lease_ttl_s: float) -> ViewerLease:
        """A lease for a new viewer of `request_id`; RESOURCE_EXHAUSTED at the tenant's max_concurrent."""
        lease_id = f"{request_id}#viewer-{uuid.uuid4().hex[:12]}"
        decision = await quota.lease(limits, lease_id)
        if not decision.admitted:
            raise rejection(limits.tenant, decision, " (a re-attached stream holds a lease)")
        return cls(quota, limits.tenant, lease_id, lease_ttl_s / 3)

    async def keep(self) -> None:
        """Renew the lease when a third of its TTL has passed since the last renewal."""
        now = time.monotonic()
        if now >= self.next_renew_s:
            self.next_renew_s = now + self.renew_every_s
            await self.quota.renew(self.tenant, self.lease_id)

    async def drop(self) -> None:
        await self.quota.drop_lease(self.tenant, self.lease_id)
