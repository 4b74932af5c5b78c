"""The soak sampler reads real process and Redis state."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from llmserve.loadgen.soak import open_fds, rss_bytes, stream_lengths, take_sample
from llmserve.protocol import queue


def test_sample_counts_request_keys_and_missing_ttls(clean_redis):
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"   # the interpreter is loaded: its RSS is real, not mid-exec
        stack = {"svc": SimpleNamespace(alive=lambda: True, process=child)}
        clean_redis.set("llmserve:{r:acme:a}:meta", "x", ex=60)
        clean_redis.xadd("llmserve:{r:acme:a}:events", {"e": "1"})          # no TTL: a leak
        clean_redis.set("llmserve:{t:acme}:rate", "1")                      # not per-request
        clean_redis.xadd("llmserve:{m:m1}:work:normal", {queue.ITEM_FIELD: "x"})
        clean_redis.xadd("llmserve:{m:m1}:inbox:w0", {queue.BATCH_FIELD: "x"})
        clean_redis.xdel("llmserve:{m:m1}:inbox:w0", clean_redis.xrange("llmserve:{m:m1}:inbox:w0")[0][0])
        clean_redis.hset("llmserve:{m:m1}:workers", "w0", "hb")
        s = take_sample(SimpleNamespace(services=stack), clean_redis, 1.5)
        assert (s.request_keys, s.request_keys_without_ttl, s.redis_keys) == (2, 1, 6)
        assert s.rss_bytes["svc"] > 1 * 1024 * 1024 and s.fds["svc"] >= 3
        assert s.redis_used_memory > 0 and s.t_s == 1.5
        assert stream_lengths(clean_redis) == {"llmserve:{m:m1}:work:normal": 1, "llmserve:{m:m1}:inbox:w0": 0}
    finally:
        child.kill()
        child.wait()
    assert rss_bytes(os.getpid()) > 0 and open_fds(os.getpid()) > 0
