"""The cluster suite: a real three-master Valkey Cluster (tests/cluster/valkey_cluster.py) and
one whole stack on it (2 workers, 2 gateways, pointed at one node, the queue split in two cells
so each worker's cell has its own slot), shared by the tests of a module.

Overrides the session fixtures of tests/conftest.py for this directory: `valkey`, `redis_url`
and `clean_redis` are the cluster's, `stack` is the cluster stack, so existing tests imported
here run unchanged on the cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from valkey_cluster import ValkeyCluster

from llmserve.local.stack import Stack, StackConfig
from llmserve.runtime import redis_client

CLUSTER_TENANTS = Path(__file__).resolve().parent / "tenants.cluster.yaml"
QUEUE_SHARDS = 2


@pytest.fixture(scope="session")
def valkey_cluster():
    cluster = ValkeyCluster(masters=3).start()
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def valkey(valkey_cluster):
    return valkey_cluster


@pytest.fixture(scope="session")
def redis_url(valkey_cluster) -> str:
    return valkey_cluster.url


@pytest.fixture
def clean_redis(valkey_cluster):
    """A sync cluster client on freshly flushed nodes."""
    valkey_cluster.flushall()
    client = redis_client.connect_sync(valkey_cluster.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def stack(valkey_cluster, tmp_path_factory):
    """The whole stack on the cluster: every service gets REDIS_URL = the first node only."""
    config = StackConfig(workers=2, gateways=2, device="cpu", port=0, tenants=CLUSTER_TENANTS,
                         redis_url=valkey_cluster.url, log_dir=tmp_path_factory.mktemp("cluster-stack"),
                         extra_env={"LLMSERVE_QUEUE_SHARDS": str(QUEUE_SHARDS)})
    running = Stack(config).start()
    yield running
    running.close()


@pytest.fixture(scope="module")
def valkey_client(stack):
    client = redis_client.connect_sync(stack.redis_url)
    yield client
    client.close()
