"""What one gateway call carries: the caller's `Call`, the request's `Meta` hash in Redis, and
how its stream ended (`StreamOutcome`), which decides the clean-up."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gateway.slo import Admitted, Asked
from gateway.tenants import Tenant


class StreamOutcome(Enum):
    """How a stream left the gateway."""

    FINISHED = "finished"      # the final event arrived
    STOPPED = "stopped"        # a stop string matched before the worker ended: stop the worker
    CANCELLED = "cancelled"    # cancelled, and the cancel grace ran out without a final event
    ABANDONED = "abandoned"    # deadline, max queue wait, or an error: stop the worker
    DETACHED = "detached"      # the client went away, or Redis did: cancel unless a resumed viewer carries on

    @property
    def cancels_the_request(self) -> bool:
        return self in (StreamOutcome.DETACHED, StreamOutcome.ABANDONED, StreamOutcome.STOPPED)


@dataclass
class Call:
    """Per-call state the handler shares with the flow."""

    tenant: Tenant
    request_id: str
    deadline: float | None                    # monotonic, from the client's deadline
    resume_from: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)  # ratelimit headers for initial metadata
    model_version: str = ""                   # metadata x-model-version: pins the version of an alias
    served_model: str = ""                    # the concrete NAME@VERSION, once routed (x-served-model)
    slo_asked: Asked = Asked()                # metadata / headers x-slo-ttft-ms, x-slo-tpot-ms
    slo: Admitted | None = None               # set when this call submitted the request (gateway/slo.py)


@dataclass
class Meta:
    """The request meta hash: who owns the request and what a resumer needs."""

    owner: str
    model: str
    prompt_tokens: int
    cost: int
    stops: list[str]
    arrival_ms: int
    enqueued_ms: int
    work_key: str = ""     # the work stream and entry id of the queued item (to tell queued from dispatched)
    entry_id: str = ""
    error: str = ""        # set when the request failed for good before any token (max queue wait)
    n: int = 1             # choices (gateway/choices.py)

    def to_redis(self) -> dict[Any, Any]:   # typed for redis-py's hset mapping
        return {"owner": self.owner, "model": self.model, "prompt_tokens": str(self.prompt_tokens),
                "cost": str(self.cost), "stops": json.dumps(self.stops), "arrival_ms": str(self.arrival_ms),
                "enqueued_ms": str(self.enqueued_ms), "work_key": self.work_key, "entry_id": self.entry_id,
                "n": str(self.n)}

    @classmethod
    def from_redis(cls, raw: dict) -> Meta:
        d = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(d["owner"], d["model"], int(d["prompt_tokens"]), int(d["cost"]), json.loads(d["stops"]),
                   int(d["arrival_ms"]), int(d["enqueued_ms"]), d.get("work_key", ""), d.get("entry_id", ""),
                   d.get("error", ""), int(d.get("n", "1")))
