"""Prometheus metrics of the batcher (served by llmserve.runtime.server on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

QUEUE_DEPTH = Gauge(
    "llmserve_batcher_queue_depth", "Items waiting on the work stream (unread + read, not dispatched)",
    ["model", "priority", "shard"])
QUEUE_AGE = Gauge(
    "llmserve_batcher_queue_oldest_age_seconds", "Age of the oldest waiting item (since enqueue)",
    ["model", "priority", "shard"])
HELD = Gauge("llmserve_batcher_held_items", "Items read ahead into this replica's local queues",
             ["model", "shard"])
BATCH_SIZE = Histogram(
    "llmserve_batcher_batch_size", "Sequences per dispatched batch", ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
BATCH_PROMPT_TOKENS = Histogram(
    "llmserve_batcher_batch_prompt_tokens", "Prompt tokens per dispatched batch", ["model"],
    buckets=(64, 256, 1024, 4096, 8192, 16384, 65536))
FILL_WAIT = Histogram(
    "llmserve_batcher_fill_wait_seconds", "How long a batch's oldest item waited in the batcher", ["model"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
DISPATCHED = Counter("llmserve_batcher_dispatched_items_total", "Items written to worker inboxes", ["model"])
RECLAIMS = Counter(
    "llmserve_batcher_reclaims_total", "Entries reclaimed (kind=batcher: from a silent batcher's pending "
    "list; kind=inbox: batches from a dead worker's inbox; kind=rehomed: items moved from a queue cell with "
    "no live worker to another cell)", ["model", "kind"])
DROPS = Counter("llmserve_batcher_drops_total", "Items ended without dispatch", ["model", "reason"])
CONFLICTS = Counter(
    "llmserve_batcher_ownership_lost_total", "Held items another replica had taken over (not dispatched here)",
    ["model"])
NO_CAPACITY = Counter(
    "llmserve_batcher_no_capacity_total", "Times a ready batch waited because no live worker could admit it",
    ["model"])
