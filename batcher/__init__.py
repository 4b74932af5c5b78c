"""Dynamic batcher and dispatcher (`python -m batcher --help`).

Per model, one loop (`model_batcher.py`):

    work streams  llmserve:{m:M}:work:{high,normal,low}   (consumer group "batchers")
        │ XREADGROUP, read ahead (--read-ahead per priority), entries stay pending
        ▼
    FairQueue (fair_queue.py): strict HIGH > NORMAL > LOW, round-robin across tenants
        │ a batch is due when max_batch items or prefill_token_budget tokens are held,
        │ or the oldest held item waited max_wait_ms (all per model: --model-overrides)
        ▼
    drop expired (DEADLINE_EXCEEDED) / cancelled (CANCELLED) / too large (RESOURCE_EXHAUSTED):
        final TokenEvent to the item's events stream, then ack
        ▼
    WorkerPool (workers.py): live (heartbeat < --heartbeat-ttl-ms), not draining, most free
        KV blocks; never more blocks/sequences than heartbeat minus what we sent since
        ▼
    Lua dispatch (scripts.py): check every item is still pending on us, XADD the Batch to
        llmserve:{m:M}:inbox:<worker>, XACK + XDEL the items, SADD llmserve:{m:M}:inboxes

Reclaim (reclaimer.py, XAUTOCLAIM): items idle --claim-idle-ms on another batcher;
batches in the inbox of a worker whose heartbeat expired or vanished go to a live worker
(deliveries + 1 for entries the dead worker had read); --max-deliveries → UNAVAILABLE.
Held items are "touched" (XCLAIM JUSTID, only if still ours) so no replica reclaims them.
SIGTERM: stop reading, dispatch what is held while workers can admit it (--grace-s),
mark the rest idle so another replica claims it at once; exit 0.

`tests/integration/queue_harness.py` is the other side of the contract (gateway enqueue,
worker heartbeat/inbox) for tests and the bench; the wire format is `llmserve.protocol.queue`'s.
"""
