"""A worker that refuses its model (exit code 2, one line: gpu_worker/model/loader.py check_supported)
is a configuration to change, not a crash to retry: `llmserve up` says that line on its own terminal
and what to change, and never starts that worker again. The GGUF is a tiny mixture-of-experts llama
with a real tokenizer (tokenizer_svc serves it; only the worker refuses it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from gpu_worker.model.architectures import SUPPORTED
from llmserve.local.stack import ServiceProcess, Stack, StackConfig
from llmserve.local.supervisor import REFUSED_EXIT_CODE, Supervisor
from tests.unit.tiny_models import GEMMA_TOKENS, write_gemma_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def moe_gguf(tmp_path) -> Path:
    path = tmp_path / "tiny-moe.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_context_length(256)
    writer.add_uint32("llama.expert_count", 8)
    write_gemma_tokenizer(writer)
    writer.add_tensor("token_embd.weight", np.zeros((len(GEMMA_TOKENS), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def worker_line(path: Path) -> str:
    return (f"python -m gpu_worker: {path}: mixture-of-experts (8 experts, architecture 'llama') "
            f"is not supported (supported: {SUPPORTED})")


def test_up_says_the_refusal_and_exits_2(moe_gguf, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = subprocess.run([str(Path(sys.executable).parent / "llmserve"), "up", "--model", str(moe_gguf),
                           "--workers", "1", "--device", "cpu", "--port", "0"],
                          cwd=run_dir, capture_output=True, text=True, timeout=240)
    assert done.returncode == REFUSED_EXIT_CODE, done.stderr[-3000:]
    said = done.stderr.splitlines()
    assert said[-2:] == [
        f"gpu_worker-0 refused its configuration (exit code 2): {worker_line(moe_gguf)}",
        "  not restarting it: change what that line names (--model, the models file, a flag) and start "
        "`llmserve up` again"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_the_supervisor_leaves_a_refused_worker_stopped(moe_gguf, tmp_path):
    stack = Stack(StackConfig(log_dir=tmp_path))
    worker = ServiceProcess("gpu_worker-0", "gpu_worker", ["--model", str(moe_gguf), "--device", "cpu"], 0,
                            tmp_path / "gpu_worker-0.log", None)
    stack.services[worker.name] = worker.start()
    assert worker.wait(120) == REFUSED_EXIT_CODE
    said: list[str] = []
    supervisor = Supervisor(stack, say=said.append)
    later = time.monotonic()
    for step in range(5):           # any backoff or crash-loop delay long over
        supervisor.poll(now=later + 3600 * step)
    assert said == [f"gpu_worker-0 refused its configuration (exit code 2): {worker_line(moe_gguf)}\n"
                    "  not restarting it: change what that line names (--model, the models file, a flag) and start "
                    "`llmserve up` again; the other services keep running"]
    assert supervisor.slots[worker.name].restarts == 0 and not worker.alive()
