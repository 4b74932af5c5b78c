"""A SentencePiece-style ("llama") GGUF vocabulary, written with gguf.GGUFWriter: score-ordered
merges, "▁" for spaces with one prepended, byte fallback, BOS added. Expected ids derived by hand."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tokenizer_svc.loader import load_tokenizer

BYTES = [f"<0x{b:02X}>" for b in range(256)]
# (piece, score): SentencePiece merges the adjacent pair whose merged piece scores highest.
PIECES = [("▁", -1.0), ("h", -2.0), ("e", -2.0), ("l", -2.0), ("o", -2.0), ("w", -2.0), ("r", -2.0), ("d", -2.0),
          ("he", -3.0), ("ll", -3.0), ("llo", -4.0), ("hello", -5.0), ("▁hello", -6.0), ("▁w", -3.5),
          ("or", -3.5), ("▁wor", -4.5), ("ld", -3.0), ("▁world", -5.5), ("lo", -9.0)]
TOKENS = ["<unk>", "<s>", "</s>", *BYTES, *(p for p, _ in PIECES), "<|user|>"]
TYPES = [2, 3, 3, *([6] * 256), *([1] * len(PIECES)), 4]
SCORES = [0.0, 0.0, 0.0, *([0.0] * 256), *(s for _, s in PIECES), 0.0]
ID = {t: i for i, t in enumerate(TOKENS)}
TEMPLATE = "{% for m in messages %}{{ bos_token }}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_context_length(512)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores(SCORES)
    writer.add_token_types(TYPES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_spm_merges_follow_scores(llama_gguf):
    model = load_tokenizer(llama_gguf)
    assert model.encode("hello world") == [ID["▁hello"], ID["▁world"]]
    assert model.encode("hello world", add_special_tokens=True) == [ID["<s>"], ID["▁hello"], ID["▁world"]]
    # "low": no "▁l"/"▁lo" piece; "lo" exists but scores below nothing else competing → ▁ l o w → ▁, lo, w
    assert model.encode("low") == [ID["▁"], ID["lo"], ID["w"]]


def test_byte_fallback_and_decode(llama_gguf):
    model = load_tokenizer(llama_gguf)
    ids = model.encode("hello é")
    assert ids == [ID["▁hello"], ID["▁"], ID["<0xC3>"], ID["<0xA9>"]]
    assert model.decode(ids) == "hello é"
    assert model.decode([ID["<s>"], *ids], skip_special_tokens=True) == "hello é"


def test_user_defined_and_control_tokens(llama_gguf):
    model = load_tokenizer(llama_gguf)
    assert model.encode("<|user|>hello") == [ID["<|user|>"], ID["▁hello"]]
    assert model.encode("</s>") == [ID["</s>"]]
    assert model.eos_token_ids == [2] and model.context_length == 512


def test_chat_template_uses_bos_and_eos(llama_gguf):
    model = load_tokenizer(llama_gguf)
    messages = [{"role": "user", "content": "hello"}]
    assert model.render_chat(messages) == "<s>[user] hello</s>"
