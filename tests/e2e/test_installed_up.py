"""`llmserve up` from a non-editable install, started in an empty directory: the wheel of this
tree's files (`pip wheel` of a copy of what git tracks or would track) installed with
`pip install --target` into a directory of the test's own, found through PYTHONPATH alone (no
checkout on the path), through to a real completion, then Ctrl-C and a clean exit. Also: the
package data the services read at run time ships in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from llmserve.client import Client
from tests.fault.up_process import UpProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("llmserve", "gateway", "tokenizer_svc", "batcher", "gpu_worker")


def git_files(*pathspecs: str) -> list[str]:
    """Files git tracks, or would (untracked, not ignored), under the checkout."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *pathspecs],
                            cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return [name for name in listed.stdout.splitlines() if os.path.lexists(REPO_ROOT / name)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy, as from a fresh clone: nothing ignored goes in, no build/ is left in the checkout."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in git_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, source / name, follow_symlinks=False)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(source)], check=True)
    (built,) = out.glob("llmserve-*.whl")
    return built


@pytest.fixture(scope="module")
def site_dir(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    return target


def test_wheel_ships_the_kernel_sources_protos_and_dev_tenants(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = git_files("gpu_worker/**.c", "gpu_worker/**.cu", "gpu_worker/**.cuh")
    assert tracked, "no kernel sources tracked under gpu_worker/"
    assert sorted(set(tracked) - names) == []
    protos = sorted((REPO_ROOT / "protos" / "llmserve" / "v1").glob("*.proto"))
    generated = {f"llmserve/v1/{p.stem}_pb2{kind}.py" for p in protos for kind in ("", "_grpc")}
    assert protos and sorted(generated - names) == []
    assert "llmserve/tenants.dev.yaml" in names


def test_up_from_an_empty_directory_of_a_non_editable_install(site_dir, tmp_path):
    env = {"PYTHONPATH": str(site_dir)}
    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    where = subprocess.run([sys.executable, "-c", f"import {', '.join(PACKAGES)}; "
                            f"print('\\n'.join(m.__file__ for m in ({', '.join(PACKAGES)})))"],
                           cwd=run_dir, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    assert all(Path(f).is_relative_to(site_dir) for f in where.stdout.split()), where.stdout   # not the checkout

    up = UpProcess.start(run_dir, workers=1, extra_env=env, llmserve=site_dir / "bin" / "llmserve")
    try:
        with Client(up.gateway_target, api_key="dev-key") as client:     # the dev tenants from the wheel
            reply = client.complete(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                    max_new_tokens=8, temperature=0.0)
        assert reply.text and reply.finish_reason in ("stop", "length")
        state = run_dir / ".llmserve"
        assert (state / "redis-url").read_text().strip() == up.redis_url
        assert {"gateway-0.log", "gpu_worker-0.log", "valkey.log"} <= {p.name for p in (state / "logs").iterdir()}
        assert any((state / "valkey" / "appendonlydir").glob("*.aof"))
    finally:
        code = up.stop()
    assert code == 0, up.stderr_text()[-3000:]
    assert "stopped: gateway-0=0, batcher=0, gpu_worker-0=0, tokenizer_svc=0" in up.stdout_text()
    assert not (run_dir / ".llmserve" / "redis-url").exists()
