"""The Valkey `llmserve up` starts, on a real server: a restart over its data returns only once the
data is loaded (INFO and PING answer during the load, writes are refused with LOADING)."""

from __future__ import annotations

import time

import redis

from llmserve.local.valkey import ValkeyServer


class SlowLoadingValkey(ValkeyServer):
    """Loads each key 200 us late and answers clients every 4 KiB of its load (the server's own
    testing settings), so the load outlasts the first answers."""

    def command(self) -> list[str]:
        return [*super().command(), "--key-load-delay", "200", "--loading-process-events-interval-bytes", "4096"]


def test_a_restart_over_its_data_returns_once_commands_run(tmp_path):
    server = SlowLoadingValkey(data_dir=tmp_path / "valkey", appendfsync="everysec").start()
    client = redis.Redis(host="127.0.0.1", port=server.port)
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(5_000):            # a load of about a second
            pipe.set(f"key:{i}", i)
        pipe.execute()
        client.bgrewriteaof()             # into the AOF's RDB base, which loads key by key
        while any(int(client.info("persistence")[field]) for field in ("aof_rewrite_scheduled",
                                                                       "aof_rewrite_in_progress")):
            time.sleep(0.02)
        server.stop()
        server.start()
        assert client.info("persistence")["loading"] == 0
        client.hset("written-after-start", mapping={"a": "1"})   # raised LOADING while the data loaded
        assert client.dbsize() == 5_001
    finally:
        client.close()
        server.close()
