"""Render a kustomization with `kubectl kustomize` (kustomize v5, on every machine here) for the tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml


def render(directory: Path) -> list[dict]:
    """Every object the kustomization in `directory` produces."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is needed to render the Kubernetes manifests (kubectl kustomize)")
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=True,
                         timeout=120)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]
