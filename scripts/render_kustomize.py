"""A small kustomize renderer for the subset deploy/k8s uses (no kustomize binary needed).

    .venv/bin/python scripts/render_kustomize.py deploy/k8s/overlays/prod > prod.yaml

Supported kustomization.yaml keys (anything else is an error, so a manifest
never silently relies on a feature this script ignores):

    resources      files or directories holding a kustomization.yaml (rendered first)
    namespace      set on every namespaced object
    commonLabels   added to metadata.labels, selectors and pod templates (kustomize's field specs)
    patches        [{path: FILE}] or [{patch: YAML}]: strategic merge patches, matched by
                   apiVersion group, kind and metadata.name of the patch itself
    images         [{name, newName?, newTag?}] rewrites container images

The order is kustomize's: a base is rendered completely (its own transformers
included) before the overlay's transformers run on the result.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION = "kustomization.yaml"
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "namespace", "commonLabels", "patches", "images"}

# Lists of objects that strategic merge patches merge element-wise, by this key (as the API server does).
# `ports` is keyed by containerPort in a pod and by port in a Service: the first key the items carry wins.
MERGE_KEYS = {
    "containers": ("name",), "initContainers": ("name",), "env": ("name",), "volumes": ("name",),
    "ports": ("containerPort", "port"), "volumeMounts": ("mountPath",), "tolerations": ("key",),
    "imagePullSecrets": ("name",),
}

# Kinds that are not namespaced among those this repo uses.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass",
                  "StorageClass", "PersistentVolume"}

WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class RenderError(ValueError):
    """The kustomization uses something this renderer does not support, or is inconsistent."""


# -- loading --------------------------------------------------------------------------------------------------
def load_documents(path: Path) -> list[dict]:
    with path.open() as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


def read_kustomization(directory: Path) -> dict:
    path = directory / KUSTOMIZATION
    if not path.exists():
        raise RenderError(f"{directory}: no {KUSTOMIZATION}")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - SUPPORTED_KEYS
    if unknown:
        raise RenderError(f"{path}: unsupported keys {sorted(unknown)} (see scripts/render_kustomize.py)")
    return data


def render(directory: str | Path) -> list[dict]:
    """Every object the kustomization at `directory` produces, transformers applied."""
    directory = Path(directory)
    k = read_kustomization(directory)
    objects: list[dict] = []
    for entry in k.get("resources", []):
        target = directory / entry
        objects += render(target) if target.is_dir() else load_documents(target)
    check_unique(objects, directory)
    for patch in load_patches(directory, k.get("patches", [])):
        apply_patch(objects, patch, directory)
    if "images" in k:
        set_images(objects, k["images"])
    if "commonLabels" in k:
        add_labels(objects, k["commonLabels"])
    if "namespace" in k:
        set_namespace(objects, k["namespace"])
    return objects


def object_id(obj: dict) -> tuple[str, str, str]:
    group = obj.get("apiVersion", "").rpartition("/")[0]
    return group, obj.get("kind", ""), obj.get("metadata", {}).get("name", "")


def check_unique(objects: list[dict], directory: Path) -> None:
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        oid = object_id(obj)
        if oid in seen:
            raise RenderError(f"{directory}: {oid} defined twice")
        seen.add(oid)


# -- patches --------------------------------------------------------------------------------------------------
def load_patches(directory: Path, entries: list[dict]) -> list[dict]:
    patches: list[dict] = []
    for entry in entries:
        if set(entry) - {"path", "patch"} or len(entry) != 1:
            raise RenderError(f"{directory}: a patch is {{path: FILE}} or {{patch: YAML}}, got {entry}")
        if "path" in entry:
            patches += load_documents(directory / entry["path"])
        else:
            patches += [doc for doc in yaml.safe_load_all(entry["patch"]) if doc]
    return patches


def apply_patch(objects: list[dict], patch: dict, directory: Path) -> None:
    oid = object_id(patch)
    for i, obj in enumerate(objects):
        if object_id(obj) == oid:
            if patch.get("$patch") == "delete":
                del objects[i]
            else:
                objects[i] = strategic_merge(obj, patch)
            return
    raise RenderError(f"{directory}: patch target {oid} not found")


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Merge `patch` into `base` the way `kubectl apply`'s strategic merge does, for the cases used here:
    maps merge key by key (null deletes), lists of objects with a merge key merge element-wise (an
    element with `$patch: delete` is removed), every other list is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and MERGE_KEYS.get(field):
        return merge_list(base, patch, MERGE_KEYS[field], field)
    return copy.deepcopy(patch)


def merge_list(base: list[dict], patch: list[dict], keys: tuple[str, ...], field: str) -> list[dict]:
    out = copy.deepcopy(base)
    for item in patch:
        key = next((k for k in keys if k in item), keys[0])
        index = next((i for i, old in enumerate(out) if old.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del out[index]
        elif index is None:
            out.append(copy.deepcopy(item))
        else:
            out[index] = strategic_merge(out[index], item, field)
    return out


# -- transformers ---------------------------------------------------------------------------------------------
def pod_specs(obj: dict) -> list[dict]:
    if obj.get("kind") in WORKLOADS:
        return [obj["spec"]["template"]["spec"]]
    return []


def set_images(objects: list[dict], images: list[dict]) -> None:
    by_name = {image["name"]: image for image in images}
    for obj in objects:
        for spec in pod_specs(obj):
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                name, _, tag = container["image"].partition(":")
                rule = by_name.get(name)
                if rule:
                    container["image"] = f"{rule.get('newName', name)}:{rule.get('newTag', tag or 'latest')}"


# Where commonLabels go besides metadata.labels (kustomize's default field specs for these kinds);
# selectors are only extended where they exist, so an empty podSelector ("all pods") stays empty.
LABEL_PATHS = {
    "Deployment": [("spec", "selector", "matchLabels"), ("spec", "template", "metadata", "labels")],
    "StatefulSet": [("spec", "selector", "matchLabels"), ("spec", "template", "metadata", "labels")],
    "Service": [("spec", "selector")],
    "PodDisruptionBudget": [("spec", "selector", "matchLabels")],
    "NetworkPolicy": [("spec", "podSelector", "matchLabels")],
}


def add_labels(objects: list[dict], labels: dict[str, str]) -> None:
    for obj in objects:
        obj.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
        for path in LABEL_PATHS.get(obj["kind"], []):
            node = obj
            for part in path[:-1]:
                node = node.get(part, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict) and isinstance(node.get(path[-1]), dict):
                node[path[-1]].update(labels)
        if obj["kind"] == "NetworkPolicy":
            for rule in obj["spec"].get("ingress", []):
                for peer in rule.get("from", []):
                    if "podSelector" in peer and "matchLabels" in peer["podSelector"]:
                        peer["podSelector"]["matchLabels"].update(labels)


def set_namespace(objects: list[dict], namespace: str) -> None:
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: render_kustomize.py DIR_WITH_KUSTOMIZATION", file=sys.stderr)
        return 2
    yaml.safe_dump_all(render(args[0]), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
