"""Offline checks of everything under deploy/ and docker-compose.yml (no Docker engine, no cluster).

- every object the kustomize base and overlays render to validates against the Kubernetes schemas
  (kubernetes-validate, strict) or, for the CRDs, against the schemas in deploy/k8s/schemas;
- docker-compose.yml validates against the Compose spec (check-jsonschema);
- every LLMSERVE_* env var and --flag the manifests, the compose file and the Dockerfiles give a service
  exists in that service's settings class, and the settings they add up to load and validate;
- drain timing: terminationGracePeriodSeconds >= preStop + drain timeout + grace (and compose's
  stop_grace_period likewise); KEDA watches the real work streams and consumer group;
- the Dockerfiles have the stages, non-root user, healthcheck and COPY sources they claim;
- the Grafana dashboard queries only metrics the services export; the image's health probe tells
  SERVING from NOT_SERVING on a real gRPC server.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import hashlib
import importlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import grpc
import jsonschema
import kubernetes_validate
import kustomize_render as kustomize
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmserve.catalog import model_store
from llmserve.protocol import keys
from llmserve.runtime.settings import CommonSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "dev": K8S / "overlays" / "dev", "prod": K8S / "overlays" / "prod"}
K8S_VERSION = "1.30.0"          # the oldest Kubernetes these manifests promise to work on (gRPC probes GA 1.27)
SERVICES = ("gateway", "tokenizer_svc", "batcher", "gpu_worker")
# LLMSERVE_* variables that are not settings: read by llmserve.catalog.model_store (where model files live).
NON_SETTING_ENV = {"LLMSERVE_CACHE_DIR"}
# Files the manifests mount (container path -> the repo file behind it), so settings that name them validate.
MODELS_FILE = K8S / "base" / "models.yaml"
MOUNTED_FILES = {"/etc/llmserve/models/models.yaml": MODELS_FILE, "/etc/llmserve/models.yaml": MODELS_FILE}
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "triggerauthentication-keda-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
}
# Placeholders for values Kubernetes fills in at run time (Secrets, the downward API).
SECRET_PLACEHOLDER = "secret-from-kubernetes"
FIELD_PLACEHOLDER = "pod-name-from-downward-api"


RENDERED = {name: kustomize.render(path) for name, path in KUSTOMIZATIONS.items()}


WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def pod_specs(obj: dict) -> list[dict]:
    return [obj["spec"]["template"]["spec"]] if obj.get("kind") in WORKLOADS else []


# -- helpers ----------------------------------------------------------------------------------------------------
def settings_class(service: str) -> type[CommonSettings]:
    """The one CommonSettings subclass in `<service>/config.py`."""
    module = importlib.import_module(f"{service}.config")
    found = [obj for obj in vars(module).values()
             if isinstance(obj, type) and issubclass(obj, CommonSettings) and obj is not CommonSettings
             and obj.__module__ == module.__name__]
    assert len(found) == 1, f"{service}/config.py must define exactly one settings class, found {found}"
    return found[0]


def env_names(cls: type[CommonSettings]) -> set[str]:
    names = set()
    for f in dataclasses.fields(cls):
        names.add(cls.env_name(f))
        if f.metadata.get("env"):
            names.add(f.metadata["env"])
    return names


def flag_names(cls: type[CommonSettings]) -> set[str]:
    return {cls.flag_name(f) for f in dataclasses.fields(cls)}


def service_of(command: list[str]) -> str | None:
    """`python -m gateway ...` -> "gateway"."""
    for i, word in enumerate(command[:-1]):
        if word == "-m" and command[i + 1] in SERVICES:
            return command[i + 1]
    return None


def flags_in(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def llmserve_containers(objects: list[dict]):
    """(workload, container, service) for every container that runs a llmserve service."""
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            service = service_of(container.get("command", []) + container.get("args", []))
            if service:
                yield obj, container, service


def container_env(objects: list[dict], container: dict) -> dict[str, str]:
    """The environment Kubernetes gives the container (envFrom first, env wins), placeholders for refs."""
    config_maps = by_kind(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in config_maps, f"envFrom names ConfigMap {name}, which is not rendered"
        env.update(config_maps[name]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "secretKeyRef" in var.get("valueFrom", {}):
            env[var["name"]] = SECRET_PLACEHOLDER
        else:
            env[var["name"]] = FIELD_PLACEHOLDER
    return env


def pre_stop_seconds(container: dict) -> int:
    """Seconds a preStop hook holds the container before SIGTERM (0 without one)."""
    pre_stop = container.get("lifecycle", {}).get("preStop")
    if not pre_stop:
        return 0
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"preStop must be a plain sleep, got {command}"
    return int(command[1])


def stop_budget_s(service: str, env: dict[str, str]) -> float:
    """How long a service may take from SIGTERM to exit: its drain (worker) plus the server's grace."""
    settings = settings_class(service).load([], env=local_files(env))
    return getattr(settings, "drain_timeout_s", 0.0) + settings.grace_s


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose_llmserve_services():
    for name, svc in compose()["services"].items():
        command = svc.get("command", [])
        if isinstance(command, str):
            command = shlex.split(command)
        service = service_of(command)
        if service:
            yield name, svc, service, command


def parse_duration_s(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_overlays_set_namespace_and_labels_everywhere():
    for name in ("dev", "prod"):
        for obj in RENDERED[name]:
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == "llmserve", (name, obj["kind"], obj["metadata"]["name"])
            assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == name
            assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "llmserve"
    # Selectors carry the common labels too, and still match their pod templates.
    for rendered in RENDERED.values():
        deployments = by_kind(rendered, "Deployment")
        assert set(deployments) == {"gateway", "tokenizer", "batcher", "worker"}
        for dep in deployments.values():
            selector = dep["spec"]["selector"]["matchLabels"]
            assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


# -- schemas ----------------------------------------------------------------------------------------------------
def validate_k8s(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        schema = json.loads((K8S / "schemas" / CRD_SCHEMAS[key]).read_text())
        jsonschema.Draft202012Validator(schema).validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_rendered_object_validates_against_its_schema(name):
    kinds = set()
    for obj in RENDERED[name]:
        try:
            validate_k8s(obj)
        except (jsonschema.ValidationError, kubernetes_validate.utils.ValidationError) as exc:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
        kinds.add(obj["kind"])
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "NetworkPolicy", "ScaledObject", "TriggerAuthentication", "ServiceMonitor"} <= kinds


def test_schema_validation_catches_mistakes():
    deployment = copy.deepcopy(by_kind(RENDERED["dev"], "Deployment")["worker"])
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 90       # misspelt field
    with pytest.raises(kubernetes_validate.utils.ValidationError):
        validate_k8s(deployment)
    scaled = copy.deepcopy(by_kind(RENDERED["dev"], "ScaledObject")["worker"])
    scaled["spec"]["maxReplicas"] = 3                                          # KEDA calls it maxReplicaCount
    with pytest.raises(jsonschema.ValidationError):
        validate_k8s(scaled)


def test_compose_file_validates_against_the_compose_spec(tmp_path):
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    ok = subprocess.run([*cmd, str(ROOT / "docker-compose.yml")], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = compose()
    broken["services"]["gateway"]["stop_grace_period"] = ["45s"]
    (tmp_path / "docker-compose.yml").write_text(yaml.safe_dump(broken))
    bad = subprocess.run([*cmd, str(tmp_path / "docker-compose.yml")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1, bad.stdout + bad.stderr


# -- settings cross-check ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_manifest_env_and_flags_are_real_settings(name):
    seen = set()
    for workload, container, service in llmserve_containers(RENDERED[name]):
        cls = settings_class(service)
        env = container_env(RENDERED[name], container)
        unknown_env = {k for k in env if k.startswith("LLMSERVE_")} - env_names(cls) - NON_SETTING_ENV
        assert not unknown_env, f"{workload['metadata']['name']}: {sorted(unknown_env)} are not {cls.__name__} settings"
        words = container.get("command", []) + container.get("args", [])
        unknown_flags = set(flags_in(words)) - flag_names(cls)
        assert not unknown_flags, f"{workload['metadata']['name']}: unknown flags {sorted(unknown_flags)}"
        settings = cls.load(flags_and_values(words), env=local_files(env))     # the values parse and validate
        assert settings.host == "0.0.0.0"
        port = int(env["LLMSERVE_PORT"])
        assert settings.port == port and settings.metrics_port == 9100
        http = {getattr(settings, "http_port", 0)} - {0}
        assert {p["containerPort"] for p in container["ports"]} == {port, 9100} | ({settings.health_port} - {0}) | http
        # kubelet's gRPC probe speaks no TLS: a TLS service is probed on its plaintext health-only port
        probe_port = settings.health_port if settings.tls_cert else port
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == probe_port, \
                f"{service} {probe} must use gRPC health on {probe_port}"
        seen.add(service)
    assert seen == set(SERVICES)


def local_files(env: dict[str, str]) -> dict[str, str]:
    """The env with `@<mounted file>` values pointing at the repo file the manifests mount there."""
    return {k: f"@{MOUNTED_FILES[v[1:]]}" if v.startswith("@") and v[1:] in MOUNTED_FILES else v
            for k, v in env.items()}


def flags_and_values(words: list[str]) -> list[str]:
    """The part of a command line after `python -m <service>`."""
    for i, word in enumerate(words):
        if word in SERVICES and i > 0 and words[i - 1] == "-m":
            return words[i + 1:]
    return []


def test_shared_configmap_holds_only_common_settings():
    common = env_names(CommonSettings)
    for name, rendered in RENDERED.items():
        for cm in by_kind(rendered, "ConfigMap").values():
            if cm["metadata"]["name"].startswith("llmserve-models"):   # a file, mounted: models_file_is_mounted
                continue
            assert set(cm["data"]) <= common, f"{name} {cm['metadata']['name']}: {set(cm['data']) - common}"


def test_compose_env_and_flags_are_real_settings():
    seen = set()
    for name, svc, service, command in compose_llmserve_services():
        cls = settings_class(service)
        env = {k: str(v) for k, v in svc["environment"].items()}
        unknown_env = {k for k in env if k.startswith("LLMSERVE_")} - env_names(cls) - NON_SETTING_ENV
        assert not unknown_env, f"compose {name}: {sorted(unknown_env)} are not {cls.__name__} settings"
        assert not set(flags_in(command)) - flag_names(cls), f"compose {name}: unknown flags"
        settings = cls.load(flags_and_values(command), env=local_files(env))
        assert settings.host == "0.0.0.0" and settings.port > 0
        assert settings.redis_url == "redis://redis:6379/0"
        seen.add(service)
    assert seen == set(SERVICES)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append(current + stripped)
        current = ""
    assert not current, f"{path}: dangling line continuation"
    out = []
    for line in logical:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_env(instructions) -> dict[str, str]:
    env = {}
    for word, rest in instructions:
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


@pytest.mark.parametrize("dockerfile, service", [("Dockerfile", None), ("Dockerfile.cuda", "gpu_worker")])
def test_dockerfile_env_are_real_settings(dockerfile, service):
    instructions = dockerfile_instructions(ROOT / "deploy" / "docker" / dockerfile)
    env = {k: v for k, v in dockerfile_env(instructions).items() if k.startswith("LLMSERVE_")}
    # The CPU image runs every service, so its defaults must be settings all of them share.
    cls = settings_class(service) if service else CommonSettings
    assert set(env) - env_names(cls) - NON_SETTING_ENV == set()
    assert env["LLMSERVE_HOST"] == "0.0.0.0"


# -- drain timing -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_termination_grace_covers_prestop_and_drain(name):
    for workload, container, service in llmserve_containers(RENDERED[name]):
        pod = workload["spec"]["template"]["spec"]
        budget = pre_stop_seconds(container) + stop_budget_s(service, container_env(RENDERED[name], container))
        assert pod["terminationGracePeriodSeconds"] >= budget, (
            f"{name} {workload['metadata']['name']}: terminationGracePeriodSeconds "
            f"{pod['terminationGracePeriodSeconds']} < preStop + drain timeout + grace = {budget}")
    worker = by_kind(RENDERED[name], "Deployment")["worker"]["spec"]["template"]["spec"]
    env = container_env(RENDERED[name], worker["containers"][0])
    assert float(env["LLMSERVE_DRAIN_TIMEOUT_S"]) >= 30, "a worker needs time to finish running sequences"
    # Front doors get a preStop so endpoint removal propagates before the server stops listening.
    for front in ("gateway", "tokenizer"):
        assert pre_stop_seconds(by_kind(RENDERED[name], "Deployment")[front]["spec"]["template"]["spec"]
                                ["containers"][0]) >= 3


def test_compose_stop_grace_covers_drain():
    for name, svc, service, _ in compose_llmserve_services():
        env = {k: str(v) for k, v in svc["environment"].items()}
        grace = parse_duration_s(svc["stop_grace_period"])
        assert grace >= stop_budget_s(service, env), f"compose {name}: stop_grace_period {grace}s too short"


# -- wiring -----------------------------------------------------------------------------------------------------
def test_models_file_is_mounted_where_the_services_read_it():
    from llmserve.catalog.models_file import parse_models

    config = parse_models(MODELS_FILE.read_text())
    for name, rendered in RENDERED.items():
        models_cm = next(cm for cm in by_kind(rendered, "ConfigMap").values()
                         if cm["metadata"]["name"].startswith("llmserve-models"))
        assert parse_models(models_cm["data"]["models.yaml"]) == config
        for workload, container, service in llmserve_containers(rendered):
            env = container_env(rendered, container)
            if service == "gpu_worker":       # each worker Deployment serves one version of the file
                assert model_store.model_id(env["LLMSERVE_MODEL"]) in config.ids, name
                continue
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
            assert env["LLMSERVE_MODELS"] == f"@{mounts['models']}/models.yaml", (name, service)
            assert volumes["models"]["configMap"]["name"] == models_cm["metadata"]["name"]


def test_keda_scales_workers_on_the_real_work_streams():
    for name in ("base", "dev", "prod"):
        rendered = RENDERED[name]
        scaled = by_kind(rendered, "ScaledObject")["worker"]
        assert scaled["spec"]["scaleTargetRef"]["name"] in by_kind(rendered, "Deployment")
        worker = by_kind(rendered, "Deployment")["worker"]["spec"]["template"]["spec"]["containers"][0]
        model = model_store.model_id(container_env(rendered, worker)["LLMSERVE_MODEL"])
        streams = {keys.work_stream(model, p) for p in keys.PRIORITY_ORDER}
        triggers = scaled["spec"]["triggers"]
        assert {t["type"] for t in triggers} == {"redis-streams"}
        assert {t["metadata"]["consumerGroup"] for t in triggers} == {keys.WORK_GROUP}
        for measure in ("lagCount", "pendingEntriesCount"):
            assert {t["metadata"]["stream"] for t in triggers if measure in t["metadata"]} == streams, (name, measure)
        auths = by_kind(rendered, "TriggerAuthentication")
        assert {t["authenticationRef"]["name"] for t in triggers} <= set(auths)
        namespace = scaled["metadata"].get("namespace", "llmserve")
        for t in triggers:       # KEDA resolves the address from its own namespace: it must be a FQDN
            host = t["metadata"]["address"].rsplit(":", 1)[0]
            assert "." in host, host
            if host.endswith(".svc.cluster.local"):
                service_name, ns = host.split(".")[:2]
                assert ns == namespace and service_name in by_kind(RENDERED["dev"], "Service")
        # Workers have no `replicas` for KEDA to fight with.
        assert "replicas" not in by_kind(rendered, "Deployment")["worker"]["spec"]


def test_references_resolve():
    for name, rendered in RENDERED.items():
        services, deployments = by_kind(rendered, "Service"), by_kind(rendered, "Deployment")
        workloads = {**deployments, **by_kind(rendered, "StatefulSet")}
        for svc in services.values():
            pods = [w for w in workloads.values()
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
            assert len(pods) == 1, f"{name}: Service {svc['metadata']['name']} selects {len(pods)} workloads"
            port_names = {p["name"] for c in pods[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
        for pdb in by_kind(rendered, "PodDisruptionBudget").values():
            assert any(pdb["spec"]["selector"]["matchLabels"].items()
                       <= d["spec"]["template"]["metadata"]["labels"].items() for d in deployments.values())
        assert by_kind(rendered, "HorizontalPodAutoscaler")["gateway"]["spec"]["scaleTargetRef"]["name"] in deployments
        monitor = by_kind(rendered, "ServiceMonitor")["llmserve"]
        scraped = [s for s in services.values()
                   if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert {s["spec"]["selector"]["app.kubernetes.io/name"] for s in scraped} == {
            "gateway", "tokenizer", "batcher", "worker"}
        assert all("metrics" in {p["name"] for p in s["spec"]["ports"]} for s in scraped)


def test_secrets_live_in_dev_only_and_dev_tenants_parse():
    from gateway.tenants import parse_tenants

    assert not by_kind(RENDERED["prod"], "Secret"), "prod secrets are created out of band, never committed"
    assert not by_kind(RENDERED["base"], "Secret")
    secret = by_kind(RENDERED["dev"], "Secret")["llmserve-secrets"]["stringData"]
    tenants = parse_tenants(secret["tenants.yaml"])
    assert tenants == parse_tenants((ROOT / "deploy" / "tenants.dev.yaml").read_text())
    assert hashlib.sha256(b"dev-key").hexdigest() in tenants
    # Every secret reference in every overlay names keys the dev Secret has (prod's must have the same).
    for name in ("dev", "prod"):
        for _, container, _ in llmserve_containers(RENDERED[name]):
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "llmserve-secrets" and ref["key"] in secret


def mounted_secret_file(workload: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the Secret volume file a container sees at `path`."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    assert "subPath" not in mount, "a subPath mount never sees a renewed Secret"
    volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    name = path[len(mount["mountPath"].rstrip("/")) + 1:]
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
    return volume["secret"]["secretName"], items[name] if items else name


def test_prod_gateway_terminates_tls_from_a_tls_secret_and_turns_reflection_off():
    rendered = RENDERED["prod"]
    workload = by_kind(rendered, "Deployment")["gateway"]
    container = workload["spec"]["template"]["spec"]["containers"][0]
    settings = settings_class("gateway").load([], env=local_files(container_env(rendered, container)))
    assert settings.reflection is False
    # the cert and key are the tls.crt / tls.key of one kubernetes.io/tls Secret (what cert-manager writes)
    assert mounted_secret_file(workload, container, settings.tls_cert) == ("gateway-tls", "tls.crt")
    assert mounted_secret_file(workload, container, settings.tls_key) == ("gateway-tls", "tls.key")
    # the plaintext health port is for kubelet only: no Service sends traffic there, no policy opens it
    health = next(p["name"] for p in container["ports"] if p["containerPort"] == settings.health_port)
    for svc in by_kind(rendered, "Service").values():
        assert all(p["targetPort"] not in (health, settings.health_port) for p in svc["spec"]["ports"])
    for policy in by_kind(rendered, "NetworkPolicy").values():
        for rule in policy["spec"].get("ingress", []):
            assert settings.health_port not in [p.get("port") for p in rule.get("ports", [])]
    # dev keeps plaintext and reflection (grpcurl against a laptop cluster)
    dev = by_kind(RENDERED["dev"], "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]
    dev_settings = settings_class("gateway").load([], env=local_files(container_env(RENDERED["dev"], dev)))
    assert dev_settings.reflection and not dev_settings.tls_cert


def test_only_the_gateway_is_reachable_from_outside():
    for rendered in RENDERED.values():
        policies = by_kind(rendered, "NetworkPolicy").values()
        assert any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") for p in policies), "default deny"
        for policy in policies:
            for rule in policy["spec"].get("ingress", []):
                if not rule.get("from"):      # open to any source
                    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "gateway"
                    assert [p["port"] for p in rule["ports"]] == [50051, 8000]  # gRPC, OpenAI HTTP
                for peer in rule.get("from", []):
                    assert "ipBlock" not in peer


def test_prod_workers_get_a_gpu_and_the_cuda_image():
    worker = by_kind(RENDERED["prod"], "Deployment")["worker"]["spec"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert worker["image"].split("/")[-1].startswith("llmserve-cuda:")
    assert container_env(RENDERED["prod"], worker)["LLMSERVE_DEVICE"] == "cuda"
    for obj in RENDERED["prod"]:
        for spec in pod_specs(obj):
            for c in spec["containers"]:
                assert not c["image"].endswith(":latest")
    dev_worker = by_kind(RENDERED["dev"], "Deployment")["worker"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in dev_worker["resources"]["requests"]


def test_cpu_workers_use_no_more_torch_threads_than_their_cpu_request():
    for name in ("base", "dev"):
        worker = by_kind(RENDERED[name], "Deployment")["worker"]["spec"]["template"]["spec"]["containers"][0]
        cpu = str(worker["resources"]["requests"]["cpu"])
        cores = int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        threads = int(container_env(RENDERED[name], worker)["LLMSERVE_TORCH_THREADS"])
        assert 1 <= threads <= max(1, cores), (name, threads, cpu)


def test_compose_worker_profiles_and_gpu_reservation():
    services = compose()["services"]
    assert "profiles" not in services["worker-cpu"], "the CPU worker must start with a plain `docker compose up`"
    assert services["worker"]["profiles"] == ["gpu"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert services["worker"]["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
    assert "--appendonly" in services["redis"]["command"] and "redis-data:/data" in services["redis"]["volumes"]
    gateway = services["gateway"]
    assert "./deploy/tenants.dev.yaml:/etc/llmserve/tenants.yaml:ro" in gateway["volumes"]
    assert gateway["environment"]["LLMSERVE_TENANTS"] == "/etc/llmserve/tenants.yaml"
    for name, svc, _, _ in compose_llmserve_services():
        assert svc["healthcheck"]["test"] == ["CMD", "grpc-health-check"], name


# -- Dockerfiles ------------------------------------------------------------------------------------------------
def dockerignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/"))
               for pat in patterns for p in prefixes)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_is_multistage_slim_nonroot_with_healthcheck(dockerfile):
    instructions = dockerfile_instructions(ROOT / "deploy" / "docker" / dockerfile)
    stages = [rest.split()[-1] for word, rest in instructions if word == "FROM"]
    assert stages == ["builder", "runtime"], stages
    last_from = max(i for i, (w, _) in enumerate(instructions) if w == "FROM")
    final = instructions[last_from:]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the runtime stage must run as non-root"
    assert any(w == "HEALTHCHECK" and "grpc-health-check" in r for w, r in final)
    assert not any(w == "RUN" and re.search(r"\b(gcc|build-essential|pip install)\b", r) for w, r in final)
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert re.search(r"pip install .*torch==\$\{TORCH_VERSION\}", runs)
    args = dict(rest.split("=", 1) for word, rest in instructions if word == "ARG" and "=" in rest)
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"]), "torch must be pinned"
    assert "llmserve fetch-model" in runs, "the model is fetched at build time"
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    for word, rest in instructions:
        if word == "COPY" and "--from=" not in rest:
            sources = [w for w in shlex.split(rest) if not w.startswith("--")][:-1]
            for src in sources:
                assert (ROOT / src).exists(), f"COPY source {src} does not exist"
                assert not dockerignored(src, ignore), f"COPY source {src} is excluded by .dockerignore"
        if word == "COPY" and "--from=" in rest:
            assert re.search(r"--from=(\w+)", rest).group(1) in stages


def test_cuda_image_is_cuda12_with_cupy():
    instructions = dockerfile_instructions(ROOT / "deploy" / "docker" / "Dockerfile.cuda")
    args = dict(rest.split("=", 1) for word, rest in instructions if word == "ARG" and "=" in rest)
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-runtime-ubuntu\d+\.\d+", args["CUDA_IMAGE"])
    assert "/cu12" in args["TORCH_INDEX_URL"]
    assert any(w == "RUN" and "'.[gpu]'" in r for w, r in instructions)
    import tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("cupy-cuda12x") for dep in extras["gpu"])
    assert dockerfile_env(instructions)["LLMSERVE_DEVICE"] == "cuda"


def test_installed_package_carries_every_data_file():
    """The images `pip install .` (not editable): every non-Python file the services read at run time
    (CUDA kernel sources and headers) must be listed in pyproject's package-data."""
    import tomllib

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package in ("llmserve", *SERVICES):
        for path in (ROOT / package).rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc", ".pyi") or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT / package).as_posix()
            assert any(fnmatch.fnmatch(rel, glob) for glob in package_data.get(package, [])), (
                f"{package}/{rel} would be missing from the image: add it to [tool.setuptools.package-data]")


# -- health probe -----------------------------------------------------------------------------------------------
def test_health_probe_script_tells_serving_from_not_serving(monkeypatch):
    spec = importlib.util.spec_from_file_location("grpc_health_check", ROOT / "deploy/docker/grpc_health_check.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe.main([f"127.0.0.1:{port}"]) == 0
        monkeypatch.setenv("LLMSERVE_PORT", str(port))      # the image's HEALTHCHECK passes no target
        assert probe.main([]) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe.main([f"127.0.0.1:{port}"]) == 1
        assert probe.check(f"127.0.0.1:{port}", "no.such.Service")[0] is False
    finally:
        server.stop(0)
    assert probe.main([f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1     # nothing listening
    monkeypatch.delenv("LLMSERVE_PORT")
    assert probe.main([]) == 2                                            # no target, no port: usage error


# -- Grafana ----------------------------------------------------------------------------------------------------
def exported_metric_names() -> set[str]:
    """Every sample name the services' metrics modules can export."""
    from prometheus_client import REGISTRY

    for service in SERVICES:
        importlib.import_module(f"{service}.metrics")
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                "summary": ("", "_sum", "_count")}
    names = set()
    for family in REGISTRY.collect():
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "llmserve-dashboard.json").read_text())
    exported = exported_metric_names()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    used = set()
    for expr in exprs:
        used |= set(re.findall(r"\b((?:llmserve|tokenizer|gen_ai)_[a-z0-9_]+)\b", expr))
    assert used and not used - exported, f"not exported: {sorted(used - exported)}"
    # Each service has at least one panel.
    for prefix in ("llmserve_gateway_", "llmserve_batcher_", "llmserve_worker_", "tokenizer_"):
        assert any(u.startswith(prefix) for u in used), prefix
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
