"""llmserve.runtime.redis_client on a real cluster: the client is chosen from any node, routes by slot
(blocking reads included), follows a slot that moved, refuses what spans slots, and never
re-sends a command."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from redis.crc import key_slot
from valkey_cluster import ValkeyCluster

from llmserve.local.valkey import ValkeyServer
from llmserve.protocol import keys
from llmserve.runtime import redis_client


def test_any_node_gives_the_cluster_client_a_plain_server_the_plain_one(valkey_cluster):
    for node in valkey_cluster.nodes:
        assert isinstance(redis_client.connect(node.url), redis_client.ClusterClient)
        assert type(redis_client.connect_sync(node.url)).__name__ == "RedisCluster"
    plain = ValkeyServer().start()
    try:
        assert type(redis_client.connect(plain.url)) is aioredis.Redis
    finally:
        plain.close()


async def test_a_fresh_clients_concurrent_first_commands_all_succeed(valkey_cluster):
    valkey_cluster.flushall()
    client = redis_client.connect(valkey_cluster.url)
    try:
        replies = await asyncio.gather(*(client.incr(f"first:{i}") for i in range(64)))
    finally:
        await client.aclose()
    assert replies == [1] * 64


async def test_blocking_read_reaches_the_streams_node(valkey_cluster):
    """XREAD BLOCK on a request stream whose slot is on another node than the one in the URL."""
    valkey_cluster.flushall()
    request = next(f"blk{i}" for i in range(100)
                   if valkey_cluster.node_of(_slot(keys.events_stream("t", f"blk{i}"))) is not valkey_cluster.nodes[0])
    stream = keys.events_stream("t", request)
    getkeys_before = _getkeys_calls(valkey_cluster)
    reader = redis_client.connect(valkey_cluster.url, socket_timeout=10.0)
    writer = redis_client.connect(valkey_cluster.url)
    try:
        read = asyncio.create_task(reader.xread({stream: "0"}, count=10, block=5000))
        await asyncio.sleep(0.2)
        await writer.xadd(stream, {"event": b"e1"})
        [[name, entries]] = await read
    finally:
        await reader.aclose()
        await writer.aclose()
    assert name.decode() == stream and [f for _, f in entries] == [{b"event": b"e1"}]
    assert _getkeys_calls(valkey_cluster) == getkeys_before    # keys found without asking a node


def _getkeys_calls(cluster) -> int:
    calls = 0
    for node in cluster.nodes:
        with node.client() as c:
            calls += c.info("commandstats").get("cmdstat_command|getkeys", {}).get("calls", 0)
    return calls


async def test_commands_spanning_slots_are_refused(valkey_cluster):
    client = redis_client.connect(valkey_cluster.url)
    try:
        with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
            await client.mget([keys.cancel_key("t", "a"), keys.cancel_key("t", "b")])
        pipe = client.pipeline(transaction=True)
        pipe.set(keys.cancel_key("t", "a"), 1)
        pipe.set(keys.cancel_key("t", "b"), 1)
        with pytest.raises(redis.exceptions.RedisClusterException):
            await pipe.execute()
    finally:
        await client.aclose()


async def test_a_timed_out_command_is_not_sent_again(valkey_cluster):
    """A node stalls writes past the socket timeout: the INCR fails with TimeoutError and nobody
    sends it again (redis-py's default cluster retry would, and the counter would be 1)."""
    valkey_cluster.flushall()
    key = "resend:{x}"
    client = redis_client.connect(valkey_cluster.url, socket_timeout=0.3)
    node = valkey_cluster.node_of(_slot(key))
    try:
        await client.set("warm:{x}", 1)                       # slot map loaded, connection open
        with node.client() as c:
            c.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
        with pytest.raises(redis.exceptions.TimeoutError):
            await client.incr(key)
        await asyncio.sleep(3.0)                              # well past the pause
        assert await client.get(key) is None
    finally:
        await client.aclose()


def _moved_replies(node) -> int:
    with node.client() as c:
        return int(c.info("errorstats").get("errorstat_MOVED", {}).get("count", 0))


def _slot(key: str) -> int:
    return key_slot(key.encode())


async def test_a_moved_slot_is_followed_and_the_command_runs_once(valkey_cluster):
    """The slot of a key moves to another node after the client loaded its map: the next INCR
    gets MOVED, is sent to the new owner and runs there exactly once."""
    valkey_cluster.flushall()
    key = "moved:{mv}"
    slot = _slot(key)
    source = valkey_cluster.node_of(slot)
    target = next(n for n in valkey_cluster.nodes if n is not source)
    client = redis_client.connect(valkey_cluster.url)
    try:
        assert await client.incr(key) == 1
        valkey_cluster.move_slot(slot, source, target)
        moved_before = _moved_replies(source)
        assert await client.incr(key) == 2
        assert _moved_replies(source) == moved_before + 1        # the redirect, followed once
        with target.client() as c:
            assert c.get(key) == "2"
    finally:
        await client.aclose()
        valkey_cluster.move_slot(slot, target, source)


async def test_the_client_rides_through_a_failover():
    """kill -9 of a master with a replica: until the replica takes over, commands to its slots fail
    fast with a retryable error (none is sent again); then the same client reaches the new master,
    which has the data, without being rebuilt."""
    cluster = ValkeyCluster(masters=3, replicas=1, node_timeout_ms=2000).start()
    doomed, replica = cluster.masters[0], cluster.replicas[0]
    key = next(f"fo:{{{i}}}" for i in range(1000) if cluster.node_of(_slot(f"fo:{{{i}}}")) is doomed)
    client = redis_client.connect(cluster.nodes[1].url)
    try:
        await client.set(key, "before")
        with doomed.client() as c:
            assert c.execute_command("WAIT", 1, 5000) == 1            # the replica has it
        doomed.stop(kill=True)
        failures, deadline = 0, time.monotonic() + 60
        while True:
            try:
                value = await client.get(key)
                break
            except redis_client.UNAVAILABLE_ERRORS:
                failures += 1
                assert time.monotonic() < deadline, "no failover within 60 s"
                await asyncio.sleep(0.2)
        assert value == b"before" and failures > 0
        assert await client.incr(key + ":n") == 1
        with replica.client() as c:
            assert c.info("replication")["role"] == "master"
    finally:
        await client.aclose()
        cluster.close()


def test_a_failover_in_progress_is_retryable_like_a_dropped_connection():
    from llmserve.runtime.retry import is_retryable
    from llmserve.runtime.server import status_for
    assert is_retryable(redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"))
    assert is_retryable(redis.exceptions.MasterDownError("MASTERDOWN Link with MASTER is down"))
    assert not is_retryable(redis.exceptions.ResponseError("WRONGTYPE"))
    code, _, _ = status_for(redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"))
    assert code == grpc.StatusCode.UNAVAILABLE
