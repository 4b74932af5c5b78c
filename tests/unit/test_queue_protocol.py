"""The queue protocol module: entries round-trip, bad entries are `Undecodable`, and a typed
error written into a final event comes back as the same error class."""

import pytest

from llmserve.protocol import queue
from llmserve.runtime import errors
from llmserve.v1 import queue_pb2


def test_entries_round_trip():
    item = queue_pb2.WorkItem(request_id="r", prompt_token_ids=[1, 2])
    batch = queue_pb2.Batch(batch_id="b", items=[item])
    event = queue_pb2.TokenEvent(request_id="r", index=3, token_ids=[9])

    def as_read(entry: dict) -> dict:
        return {k.encode(): v for k, v in entry.items()}   # redis-py replies with bytes keys

    assert queue.decode_item(as_read(queue.item_entry(item))) == item
    assert queue.decode_batch(as_read(queue.batch_entry(batch))) == batch
    assert queue.decode_event(as_read(queue.event_entry(event))) == event


@pytest.mark.parametrize("fields", [{}, {b"item": b"x"}, {b"batch": b"\xff\x00 not a Batch"}])
def test_a_bad_entry_is_undecodable(fields):
    with pytest.raises(queue.Undecodable):
        queue.decode_batch(fields)


@pytest.mark.parametrize("error", [errors.DeadlineExceeded("late"), errors.Unavailable("down"),
                                   errors.InvalidArgument("prompt_token_ids", "empty"),
                                   errors.ResourceExhausted("kv_cache", 0, "too big"),
                                   errors.PermissionDenied("no")])
def test_final_event_carries_the_typed_error(error):
    item = queue_pb2.WorkItem(request_id="r", prompt_token_ids=[1, 2, 3], generated_token_ids=[5])
    event = queue.final_event(item, error)
    assert (event.final, event.index, event.prompt_tokens) == (True, 1, 3)
    back = queue.error_of(event)
    assert type(back) is type(error) and back.code == error.code and error.message in back.message


def test_expiry():
    item = queue_pb2.WorkItem(deadline_unix_ms=1000)
    assert queue.is_expired(item, 1000) and not queue.is_expired(item, 999)
    assert not queue.is_expired(queue_pb2.WorkItem(), 10**15)
