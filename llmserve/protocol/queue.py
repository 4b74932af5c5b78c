"""The Redis queue protocol's one owner: what an entry of each stream holds, how it is
encoded and decoded, consumer-group creation, ack-and-delete, the expiry predicate, and the
final events that end a request with a typed error. Key names live in `llmserve.protocol.keys`.

    work stream   {ITEM_FIELD: WorkItem}     gateway XADD ─▶ batcher (group keys.WORK_GROUP)
    inbox stream  {BATCH_FIELD: Batch}       batcher ─▶ one worker (group keys.INBOX_GROUP)
    events stream {EVENT_FIELD: TokenEvent}  worker / batcher ─▶ gateway (XREAD)

A failed request's last event carries `EventError(code, message)`: `event_error` writes it
from a `ServiceError`, `error_of` turns it back into the same class on the gateway side.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.message import DecodeError
from redis.exceptions import ResponseError

from llmserve.runtime import redis_client
from llmserve.runtime.clock import now_ms
from llmserve.runtime.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
)
from llmserve.v1 import inference_pb2, queue_pb2

ITEM_FIELD = "item"
BATCH_FIELD = "batch"
EVENT_FIELD = "event"


class Undecodable(ValueError):
    """A stream entry without its field, or whose bytes are no valid message."""


# -- entries -------------------------------------------------------------------------------------------------
def item_entry(item: queue_pb2.WorkItem) -> dict[Any, Any]:   # typed for redis-py's xadd fields
    return {ITEM_FIELD: item.SerializeToString()}


def batch_entry(batch: queue_pb2.Batch) -> dict[Any, Any]:
    return {BATCH_FIELD: batch.SerializeToString()}


def event_entry(event: queue_pb2.TokenEvent) -> dict[str, bytes]:
    return {EVENT_FIELD: event.SerializeToString()}


def _decode(fields: Mapping, name: str, message_type):
    raw = fields.get(name.encode()) if name.encode() in fields else fields.get(name)
    if raw is None:
        raise Undecodable(f"entry has no {name!r} field (fields: {sorted(map(str, fields))})")
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise Undecodable(f"{name!r} is no valid {message_type.__name__}: {exc}") from None


def decode_item(fields: Mapping) -> queue_pb2.WorkItem:
    return _decode(fields, ITEM_FIELD, queue_pb2.WorkItem)


def decode_batch(fields: Mapping) -> queue_pb2.Batch:
    return _decode(fields, BATCH_FIELD, queue_pb2.Batch)


def decode_event(fields: Mapping) -> queue_pb2.TokenEvent:
    return _decode(fields, EVENT_FIELD, queue_pb2.TokenEvent)


# -- groups and acks ------------------------------------------------------------------------------------------
async def ensure_group(redis: redis_client.AnyRedis, stream: str, group: str) -> None:
    """Create `group` on `stream` from its first entry (and the stream); an existing group is fine."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def ack_and_delete(pipe, stream: str, group: str, entry_ids: list[str]) -> None:
    """Queue XACK + XDEL of entries that are done (nothing of them is read again)."""
    pipe.xack(stream, group, *entry_ids)
    pipe.xdel(stream, *entry_ids)


def is_expired(item: queue_pb2.WorkItem, at_unix_ms: int | None = None) -> bool:
    """Whether the item's absolute deadline has passed (0 = no deadline)."""
    at_unix_ms = now_ms() if at_unix_ms is None else at_unix_ms
    return 0 < item.deadline_unix_ms <= at_unix_ms


# -- final events and errors ----------------------------------------------------------------------------------
def event_error(error: ServiceError) -> queue_pb2.EventError:
    return queue_pb2.EventError(code=error.code.name, message=error.message)


def final_event(item: queue_pb2.WorkItem, error: ServiceError | None = None,
                finish_reason: inference_pb2.FinishReason = inference_pb2.FINISH_REASON_UNSPECIFIED,
                ) -> queue_pb2.TokenEvent:
    """The last event of a request that ends without (more) tokens: an error, or a finish reason."""
    event = queue_pb2.TokenEvent(request_id=item.request_id, index=len(item.generated_token_ids), final=True,
                                 prompt_tokens=len(item.prompt_token_ids), finish_reason=finish_reason)
    if error is not None:
        event.error.CopyFrom(event_error(error))
    return event


_BY_CODE: dict[str, type[ServiceError]] = {
    cls.code.name: cls for cls in (Unauthenticated, PermissionDenied, NotFound, Unavailable, DeadlineExceeded)
}


def error_of(event: queue_pb2.TokenEvent) -> ServiceError:
    """The ServiceError a final event's EventError stands for (UNAVAILABLE for an unknown code)."""
    code, message = event.error.code, event.error.message or "generation failed"
    if code == "INVALID_ARGUMENT":
        return InvalidArgument("request", message)
    if code == "RESOURCE_EXHAUSTED":
        return ResourceExhausted("capacity", 1000, message)
    return _BY_CODE.get(code, Unavailable)(message)
