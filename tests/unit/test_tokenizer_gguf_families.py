"""The tokenizer families of the supported architectures, from a GGUF's `tokenizer.ggml.*`, against
transformers' own GGUF tokenizer reader (an independent implementation) and, for byte-level BPE,
against the tokenizer the vocabulary was trained with:

    Llama 3  gpt2 BPE, pre "llama-bpe"     <|eot_id|> ends a turn though <|end_of_text|> is EOS
    Qwen2/3  gpt2 BPE, pre "qwen2"         NFC, single digits; <|im_end|>
    Gemma    SentencePiece, no space prefix, runs of spaces stored as spaces, merges by token order;
             <end_of_turn>
    Phi-3    SentencePiece with a space prefix; <|end|>
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from llmserve.catalog.gguf_vocab import LLAMA3_PATTERN, QWEN2_PATTERN
from tokenizer_svc.loader import load_tokenizer

pytest.importorskip("transformers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we've   tested 1234567 tokens!",
    "Hello world\n\nHello  world\t tabs and    spaces; don't stop. I'll see you're ready.",
    "Grüße aus München: naïve café, 日本語のテキスト, emoji 🙂 and numbers 3.14159 and 42.",
    "def main():\n    return [x * 2 for x in range(10)]  # code\r\n",
]
TEXTS = [*CORPUS, "  leading spaces", "trailing  ", "unseen: zyxwvut QQQ 987654321", "a\n\n\nb", "Ünïcödé ß 😀😀"]
TEMPLATES = {
    "llama": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
             "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
             "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    "qwen3": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "gemma3": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
              "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    "phi3": "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
}


def _write(path: Path, arch: str, model: str, tokens: list[str], types: list[int], bos: int, eos: int,
           pre: str | None = None, merges: list[str] | None = None, scores: list[float] | None = None,
           add_space_prefix: bool | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(1024)
    writer.add_tokenizer_model(model)
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_chat_template(TEMPLATES[arch])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def train_bpe(pattern: str, specials: list[str], nfc: bool) -> Tokenizer:
    """A byte-level BPE with the model's pre-tokenizer, trained on CORPUS (the 'tokenizer.json' side)."""
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


def bpe_gguf(path: Path, arch: str, pre: str, pattern: str, specials: list[str], eos: str, nfc: bool):
    trained = train_bpe(pattern, specials, nfc)
    model = json.loads(trained.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    return trained, _write(path, arch, "gpt2", tokens, types, bos=tokens.index(specials[0]), eos=tokens.index(eos),
                           pre=pre, merges=merges)


BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["▁", "e", "l", "o", "h", "w", "r", "d", "t", "s", "a", "n", "he", "ll", "llo", "hello", "▁hello", "▁w",
          "or", "▁wor", "ld", "▁world", "lo", "▁t", "▁th", "th", "▁the", "st", "▁te", "▁test", "an", "▁an", "▁and"]


def spm_gguf(path: Path, arch: str, specials: list[str], eos: str, add_space_prefix: bool) -> Path:
    """A SentencePiece vocabulary: byte tokens, pieces, Gemma's runs of spaces as spaces; the scores
    disagree with the token order on purpose (Gemma merges by order, the others by score)."""
    spaces = ["  ", "   "] if arch == "gemma3" else []
    tokens = ["<unk>", *specials, *BYTES, *PIECES, *spaces]
    scores = [0.0] * (1 + len(specials) + 256) + [-float((7 * i) % len(PIECES)) for i in range(len(PIECES))] \
        + [-1.0] * len(spaces)
    types = [gguf.TokenType.UNKNOWN, *[gguf.TokenType.CONTROL] * len(specials), *[gguf.TokenType.BYTE] * 256,
             *[gguf.TokenType.NORMAL] * (len(PIECES) + len(spaces))]
    return _write(path, arch, "llama", tokens, types, bos=tokens.index(specials[0]), eos=tokens.index(eos),
                  scores=scores, add_space_prefix=add_space_prefix)


FAMILIES = {
    "llama": lambda p: bpe_gguf(p, "llama", "llama-bpe", LLAMA3_PATTERN, [
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|end_of_text|>", nfc=False),
    "qwen3": lambda p: bpe_gguf(p, "qwen3", "qwen2", QWEN2_PATTERN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                "<|im_end|>", nfc=True),
    "gemma3": lambda p: (None, spm_gguf(p, "gemma3", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<eos>",
                                        add_space_prefix=False)),
    "phi3": lambda p: (None, spm_gguf(p, "phi3", ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"], "</s>",
                                      add_space_prefix=True)),
}
END_OF_TURN = {"llama": ["<|end_of_text|>", "<|eot_id|>"], "qwen3": ["<|im_end|>", "<|endoftext|>"],
               "gemma3": ["<eos>", "<end_of_turn>"], "phi3": ["</s>", "<|end|>"]}
TURN_END = {"llama": "<|eot_id|>", "qwen3": "<|im_end|>", "gemma3": "<end_of_turn>", "phi3": "<|end|>"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    trained, path = FAMILIES[request.param](directory / "tok.gguf")
    return request.param, trained, path


def _transformers(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_ids_match_transformers_and_the_trained_tokenizer(family):
    arch, trained, path = family
    ours, theirs = load_tokenizer(path), _transformers(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), (arch, text)
        if trained is not None:
            assert ids == trained.encode(text).ids, (arch, text)
        assert ours.decode(ids) == text or arch in ("gemma3", "phi3")  # unseen pieces: byte fallback round-trips
    assert ours.decode(ours.encode(TEXTS[0])) == TEXTS[0]


def test_eos_set_ends_turns_and_the_template_comes_from_the_file(family):
    arch, _, path = family
    ours = load_tokenizer(path)
    assert [ours.tokenizer.id_to_token(i) for i in ours.eos_token_ids] == END_OF_TURN[arch]
    prompt = ours.render_chat([{"role": "user", "content": "hello world"}])
    end = TURN_END[arch]
    assert "hello world" + end in prompt and ours.encode(prompt).count(ours.tokenizer.token_to_id(end)) == 1
