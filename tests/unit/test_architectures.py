"""Every supported architecture against an independent oracle: transformers' own model classes build a
tiny random-weight checkpoint (tests/unit/tiny_models.py), and llmserve's paged, batched steps over the
very same files (safetensors, GGUF F32, GGUF Q8_0) must give transformers' logits.

Tolerance: |ours - transformers| <= TOL[format] * max |logit| of the row, over a chunked prefill, a
second sequence batched beside it and decode steps past the sliding window. fp32 both sides: 1e-4;
Q8_0: our loader stores dequantized weights as fp16 (transformers keeps fp32): 1e-2.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from tiny_models import ARCHS, BASE, SAFETENSORS_VARIANTS, make_hf_dir, transformers_logits, write_gguf

from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.loader import load_model
from gpu_worker.model.metadata import AttentionMetadata

pytest.importorskip("transformers")

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
TOL = {"safetensors": 1e-4, "safetensors-variant": 1e-4, "gguf-f32": 1e-4, "gguf-q8_0": 1e-2}
GGUF_ARCHS = list(ARCHS)
# what transformers' GGUF reader ignores (Llama 3's rope_freqs, Mistral's window): their F32 GGUFs are
# checked against transformers reading the safetensors the GGUF was written from
SAFETENSORS_ORACLE = ("llama3", "mistral")
BLOCK = 4
TABLES = {"a": [5, 2, 9, 11, 3, 14], "b": [7, 1, 12, 8, 4, 6]}  # non-contiguous blocks
SEQS = {"a": [3, 17, 5, 90, 44, 2, 61, 8, 8, 30, 71, 12, 99, 4, 33, 7, 1, 64],
        "b": [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]}
# (seq, first position, count, is_decode), prefills first: a whole prompt beside b's first chunk, b's
# second chunk over its cached prefix beside a decode, then decodes only, well past a window of 4
STEPS = [[("a", 0, 10, False), ("b", 0, 7, False)],
         [("b", 7, 5, False), ("a", 10, 1, True)],
         *[[("b", 12 + i, 1, True), ("a", 11 + i, 1, True)] for i in range(4)]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> its HF directory (with GGUF copies beside the weights); one per architecture per session."""
    root = tmp_path_factory.mktemp("archs")
    made = {}
    for arch in ARCHS:
        d = make_hf_dir(arch, root / arch)
        if arch in GGUF_ARCHS:
            write_gguf(d, arch, d / "f32.gguf", F32)
            write_gguf(d, arch, d / "q8_0.gguf", Q8_0)
        if arch in SAFETENSORS_VARIANTS:
            made[f"{arch}-variant"] = make_hf_dir(arch, root / f"{arch}-variant", variant=True, seed=1)
        made[arch] = d
    return made


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _meta(chunks) -> tuple[list[int], list[int], AttentionMetadata]:
    i32 = torch.int32
    width = max(len(t) for t in TABLES.values())
    ordered = [c for c in chunks if not c[3]] + [c for c in chunks if c[3]]
    ids, positions, slots, logits_idx, starts = [], [], [], [], [0]
    for seq, first, count, _ in ordered:
        for p in range(first, first + count):
            ids.append(SEQS[seq][p])
            positions.append(p)
            slots.append(TABLES[seq][p // BLOCK] * BLOCK + p % BLOCK)
        logits_idx.append(len(ids) - 1)
    prefills, decodes = [c for c in ordered if not c[3]], [c for c in ordered if c[3]]
    for _, _, count, _ in prefills:
        starts.append(starts[-1] + count)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_prefills=len(prefills),
        num_prefill_tokens=starts[-1], prefill_query_start_loc=torch.tensor(starts, dtype=i32),
        prefill_context_lens=torch.tensor([f + c for _, f, c, _ in prefills], dtype=i32),
        prefill_block_tables=torch.tensor([TABLES[s] for s, *_ in prefills], dtype=i32).view(-1, width),
        decode_context_lens=torch.tensor([f + c for _, f, c, _ in decodes], dtype=i32),
        decode_block_tables=torch.tensor([TABLES[s] for s, *_ in decodes], dtype=i32).view(-1, width),
        logits_indices=torch.tensor(logits_idx, dtype=torch.int64),
    )
    return ids, positions, meta


def check_against_transformers(model, expected: dict[str, torch.Tensor], tol: float) -> None:
    cache = KVCache.allocate(model.config, 16, BLOCK, torch.float32, "cpu")
    for chunks in STEPS:
        ids, positions, meta = _meta(chunks)
        logits = model(torch.tensor(ids), torch.tensor(positions), meta, cache)
        ordered = [c for c in chunks if not c[3]] + [c for c in chunks if c[3]]
        for row, (seq, first, count, _) in enumerate(ordered):
            want = expected[seq][first + count - 1]
            torch.testing.assert_close(logits[row].double(), want, rtol=0, atol=tol * want.abs().max().item(),
                                       msg=lambda m, s=seq, p=first + count - 1: f"{s}@{p}: {m}")


def _case(checkpoints, arch: str, fmt: str):
    """(path llmserve loads, transformers' logits per sequence) for one architecture and format."""
    if fmt == "safetensors-variant":
        d = checkpoints[f"{arch}-variant"]
        return d, {s: transformers_logits(d, ids) for s, ids in SEQS.items()}
    d = checkpoints[arch]
    gguf_file = {"gguf-f32": "f32.gguf", "gguf-q8_0": "q8_0.gguf"}.get(fmt)
    path = d / gguf_file if gguf_file else d
    oracle_file = None if arch in SAFETENSORS_ORACLE else gguf_file
    return path, {s: transformers_logits(d, ids, oracle_file) for s, ids in SEQS.items()}


CASES = ([(a, "safetensors") for a in ARCHS]
         + [(a, f) for a in GGUF_ARCHS for f in ("gguf-f32", "gguf-q8_0") if a not in SAFETENSORS_ORACLE or f == "gguf-f32"]
         + [(a, "safetensors-variant") for a in SAFETENSORS_VARIANTS])


@pytest.mark.parametrize(("arch", "fmt"), CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_logits_match_transformers(checkpoints, arch, fmt):
    path, expected = _case(checkpoints, arch, fmt)
    model = load_model(path, "cpu", torch.float32)
    llama_cpp_writes_llama = fmt.startswith("gguf") and arch == "mistral"
    assert model.config.architecture == ("llama" if llama_cpp_writes_llama else {"llama3": "llama"}.get(arch, arch))
    assert model.config.vocab_size == BASE["vocab_size"]
    check_against_transformers(model, expected, TOL[fmt])
