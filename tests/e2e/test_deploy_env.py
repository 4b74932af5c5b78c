"""The Kubernetes dev overlay's configuration starts a working stack.

Each service runs as its pod would: the container's command, the shared ConfigMap, the container's env
(Secret references empty: the test Valkey has no password; the downward-API pod name filled in), the
ConfigMap volumes it mounts (written to a temp dir, paths under the mount point pointed there). Only
addresses change: 127.0.0.1 and free ports instead of pod IPs and fixed ports. One request goes through,
then every service gets SIGTERM and must exit 0 (the drain path the manifests' grace periods are sized for).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import kustomize_render as kustomize
import pytest

from llmserve.catalog import model_store
from llmserve.local.stack import ServiceProcess
from llmserve.local.valkey import ValkeyServer, free_port
from llmserve.protocol import keys
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]

START_ORDER = ("tokenizer", "batcher", "worker", "gateway")
POD_NAMES = {name: f"{name}-5d8f7c9b4-x2x7q" for name in START_ORDER}


def render_dev() -> list[dict]:
    return kustomize.render(REPO_ROOT / "deploy" / "k8s" / "overlays" / "dev")


def pod_env(objects: list[dict], container: dict, pod_name: str) -> dict[str, str]:
    config_maps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_") and k != "REDIS_URL"}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = ""
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[var["name"]] = pod_name
    return env


def mount_config_maps(objects: list[dict], pod_spec: dict, container: dict, root) -> dict[str, str]:
    """The ConfigMap volumes `container` mounts, their files written under `root`: mount path -> local dir."""
    config_maps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    volumes = {v["name"]: v["configMap"]["name"] for v in pod_spec.get("volumes", []) if "configMap" in v}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] in volumes:
            local = root / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            for filename, text in config_maps[volumes[mount["name"]]].items():
                (local / filename).write_text(text)
            mounts[mount["mountPath"]] = str(local)
    return mounts


@pytest.fixture
def valkey():
    """A Valkey of its own: no heartbeats or queues left over from other tests."""
    server = ValkeyServer().start()
    yield server
    server.close()


def test_dev_overlay_config_serves_and_drains(valkey, tmp_path, auth_metadata):
    objects = render_dev()
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    procs: dict[str, ServiceProcess] = {}
    try:
        for name in START_ORDER:
            pod_spec = deployments[name]["spec"]["template"]["spec"]
            container = pod_spec["containers"][0]
            env = pod_env(objects, container, POD_NAMES[name])
            for mount_path, local in mount_config_maps(objects, pod_spec, container, tmp_path / name).items():
                env = {k: v.replace(mount_path, local) for k, v in env.items()}
            env.update(LLMSERVE_HOST="127.0.0.1",
                       LLMSERVE_METRICS_PORT=str(free_port()), LLMSERVE_REDIS_URL=valkey.url, PYTHONUNBUFFERED="1")
            if name == "gateway":
                env["LLMSERVE_TOKENIZER_TARGET"] = env["LLMSERVE_TOKENIZER_TARGET"].replace(
                    "tokenizer:50052", procs["tokenizer"].target)
                env["LLMSERVE_TENANTS"] = str(REPO_ROOT / "deploy" / "tenants.dev.yaml")
            command = container["command"] + container.get("args", [])
            assert command[:2] == ["python", "-m"]
            procs[name] = ServiceProcess(name, command[2], command[3:], 0, tmp_path / f"{name}.log", env).start()
            procs[name].wait_serving(time.monotonic() + 300)

        with grpc.insecure_channel(procs["gateway"].target) as channel:
            reply = inference_pb2_grpc.InferenceStub(channel).Complete(
                pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
                                   sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=16)),
                metadata=auth_metadata, timeout=180)
        assert "Paris" in reply.text

        import redis

        client = redis.Redis.from_url(valkey.url)
        worker_env = pod_env(objects, deployments["worker"]["spec"]["template"]["spec"]["containers"][0], "")
        served = model_store.model_id(worker_env["LLMSERVE_MODEL"])
        assert client.hkeys(keys.workers_hash(served)) == [POD_NAMES["worker"].encode()]
        client.close()
    finally:
        codes = {name: procs[name].stop(timeout_s=120) for name in reversed(START_ORDER) if name in procs}
    assert codes == {name: 0 for name in START_ORDER}, {n: procs[n].log_tail() for n in procs}
