"""Redis key names. Everything lives under `llmserve:`.

Keys that one Lua script or MULTI touches share a hash tag, so the same code
runs on Redis Cluster:

    llmserve:{m:<model>}:work:<priority>     work stream (gateway XADD, batcher group)
    llmserve:{m:<model>}:inbox:<worker_id>   a worker's inbox stream of batches
    llmserve:{m:<model>}:workers             hash worker_id -> WorkerHeartbeat bytes
    llmserve:{m:<model>}:inboxes             set of worker ids the batcher wrote an inbox for
    llmserve:{m:<model>}:cell_joins          counter: tickets of workers joining a queue cell
    llmserve:{m:<model>:<k>}:...             the same four, for queue shard k >= 1
    llmserve:{r:<tenant>:<id>}:events        per-request token-event stream (TTL)
    llmserve:{r:<tenant>:<id>}:cancel        exists once the request is cancelled
    llmserve:{r:<tenant>:<id>}:cancel:<i>    exists once choice i (n > 1) ended at the gateway
    llmserve:{r:<tenant>:<id>}:meta          hash: owner, created, state (TTL, renewed by event writes)
    llmserve:{r:<tenant>:<id>}:epoch         hash: issued, fence (fencing tokens, see llmserve/protocol/fencing.py)
    llmserve:{t:<tenant>}:rate|tokens|leases per-tenant quota state

Queue shards: one `{m:<model>}` slot carries all of a model's queue traffic, so on a
cluster one shard would fill first. With `queue_shards` = K > 1 a model's queue is K
independent cells, each with its own slot: cell k holds its work streams, its workers'
inboxes and heartbeats. A worker joins one cell, the gateway puts each request in a cell
that has live workers, and the batcher runs one batch loop per cell. Cell 0 keeps the
unsharded names, so K = 1 is the same key space as before.
"""

from __future__ import annotations

from llmserve.v1 import inference_pb2

PREFIX = "llmserve"
WORK_GROUP = "batchers"
INBOX_GROUP = "workers"

PRIORITY_NAMES: dict[int, str] = {
    inference_pb2.PRIORITY_LOW: "low",
    inference_pb2.PRIORITY_NORMAL: "normal",
    inference_pb2.PRIORITY_HIGH: "high",
}
# Strict order in which the batcher serves the classes.
PRIORITY_ORDER = (inference_pb2.PRIORITY_HIGH, inference_pb2.PRIORITY_NORMAL, inference_pb2.PRIORITY_LOW)


def priority_name(priority: int) -> str:
    return PRIORITY_NAMES.get(priority, "normal")


def queue_tag(model: str, shard: int = 0) -> str:
    """The hash tag of one queue cell of `model` (see the module docstring)."""
    return f"{{m:{model}}}" if shard == 0 else f"{{m:{model}:{shard}}}"


def work_stream(model: str, priority: int, shard: int = 0) -> str:
    return f"{PREFIX}:{queue_tag(model, shard)}:work:{priority_name(priority)}"


def inbox_stream(model: str, worker_id: str, shard: int = 0) -> str:
    return f"{PREFIX}:{queue_tag(model, shard)}:inbox:{worker_id}"


def workers_hash(model: str, shard: int = 0) -> str:
    return f"{PREFIX}:{queue_tag(model, shard)}:workers"


def inboxes_set(model: str, shard: int = 0) -> str:
    """Worker ids that have (had) an inbox; the batcher scans it to reclaim dead workers' batches."""
    return f"{PREFIX}:{queue_tag(model, shard)}:inboxes"


def cell_joins(model: str) -> str:
    """A counter each joining worker increments (llmserve/protocol/queue_cells.py breaks ties with it)."""
    return f"{PREFIX}:{queue_tag(model)}:cell_joins"


def request_uid(tenant: str, request_id: str) -> str:
    return f"{tenant}:{request_id}"


def events_stream(tenant: str, request_id: str) -> str:
    return f"{PREFIX}:{{r:{request_uid(tenant, request_id)}}}:events"


def cancel_key(tenant: str, request_id: str) -> str:
    return f"{PREFIX}:{{r:{request_uid(tenant, request_id)}}}:cancel"


def choice_cancel_key(cancel_key: str, choice: int) -> str:
    """Of the request with `cancel_key`: exists once its choice `choice` ended at the gateway (a stop
    string) while other choices run on; the worker then stops that choice (same hash tag)."""
    return f"{cancel_key}:{choice}"


def request_meta(tenant: str, request_id: str) -> str:
    return f"{PREFIX}:{{r:{request_uid(tenant, request_id)}}}:meta"


def request_epoch(tenant: str, request_id: str) -> str:
    return f"{PREFIX}:{{r:{request_uid(tenant, request_id)}}}:epoch"


def tenant_key(tenant: str, what: str) -> str:
    return f"{PREFIX}:{{t:{tenant}}}:{what}"
