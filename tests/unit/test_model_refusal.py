"""What the worker cannot run is refused in one line naming the file, what is unsupported and what is
supported, from metadata alone; `python -m gpu_worker` exits 2 with that line instead of a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from gpu_worker.model.architectures import SUPPORTED, UnsupportedModel
from gpu_worker.model.loader import check_supported

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def hf_dir(path: Path, **cfg) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA | cfg))
    return path


def gguf_file(path: Path, arch: str, **fields: int) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    for key, value in fields.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


REFUSED = {
    "unknown model_type": (lambda d: hf_dir(d, model_type="gpt2"), "model_type 'gpt2'"),
    "hf mixture-of-experts": (lambda d: hf_dir(d, model_type="qwen2", num_experts=8), "mixture-of-experts (8 experts)"),
    "vision tower": (lambda d: hf_dir(d, model_type="gemma3", vision_config={"hidden_size": 8}, text_config={}),
                     "a vision tower (model_type 'gemma3' is multimodal)"),
    "longrope": (lambda d: hf_dir(d, model_type="phi3", rope_scaling={"type": "longrope", "long_factor": [1.0]}),
                 "rope scaling 'longrope'"),
    "partial rope": (lambda d: hf_dir(d, model_type="phi3", partial_rotary_factor=0.75),
                     "partial rotary embeddings (partial_rotary_factor < 1)"),
    "gguf mixture-of-experts": (lambda d: gguf_file(d.with_suffix(".gguf"), "llama", expert_count=8),
                                "mixture-of-experts (8 experts, architecture 'llama')"),
    "gguf unknown architecture": (lambda d: gguf_file(d.with_suffix(".gguf"), "clip"), "GGUF architecture 'clip'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_in_one_line_naming_the_file(tmp_path, case):
    make, what = REFUSED[case]
    path = make(tmp_path / "m")
    with pytest.raises(UnsupportedModel) as err:
        check_supported(path)
    assert str(err.value) == f"{path}: {what} is not supported (supported: {SUPPORTED})"


def test_the_worker_exits_with_the_line(tmp_path):
    path = hf_dir(tmp_path / "moe", num_local_experts=8)
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "gpu_worker", "--model", str(path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert done.stderr == f"python -m gpu_worker: {path}: mixture-of-experts (8 experts) is not supported " \
                          f"(supported: {SUPPORTED})\n"
