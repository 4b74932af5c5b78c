"""Token ids of the loaded SmolLM2 tokenizer against three references that share no code with the loader:

1. ids published by people who ran `transformers` on SmolLM2-135M-Instruct (chat prompts);
2. a pure-Python GPT-2 byte-level BPE (unicodedata categories for the regex, merges by rank)
   fed with the vocab/merges read straight from the GGUF;
3. a Hugging Face directory written from the GGUF data in the layout of SmolLM2's own
   tokenizer.json (Digits + ByteLevel), loaded through `tokenizers.Tokenizer.from_file`.
"""

from __future__ import annotations

import json
import pickle
import unicodedata
from functools import cache
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from llmserve.catalog.gguf_file import metadata
from tokenizer_svc.chat_template import ChatTemplateError
from tokenizer_svc.loader import load_tokenizer

CORPUS = [
    "Hello, world!",
    "The year 2024 had 366 days; π≈3.14159 and 1,000,000 > 999999.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキストも少し。한국어도 조금.",
    "Emoji: 🎉🚀👩‍💻 and flags 🇫🇷🇯🇵, skin tones 👍🏽.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }\t// loop\r\n",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\n\n\nnewlines \n \n  mixed   \t ",
    "it's they're we've I'm you'll he'd don't O'Neil 'quoted'",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "special <|endoftext|> inside <file_sep> text <jupyter_code>x=1",
    "Ünïcödé àccents — em-dash “quotes” …ellipsis ½ ² ³ ٣ ४",
    "ÀÉÎÕÜ ñ ç ß ø å æ œ",
    "https://example.com/path?query=1&x=%20y#frag",
    "    \n\n",
    "",
    "a",
    "1234567890" * 5,
    "Ā" * 40 + " zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz",
]


# --------------------------------------------------------------------------- reference 2: pure-Python BPE

def _bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _cat(ch: str) -> str:
    if ch.isspace():
        return "s"
    major = unicodedata.category(ch)[0]
    return {"L": "L", "N": "N"}.get(major, "o")


def _run(text: str, i: int, kind: str) -> int:
    while i < len(text) and _cat(text[i]) == kind:
        i += 1
    return i


def _gpt2_pieces(text: str) -> list[str]:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+ by hand."""
    pieces, i, n = [], 0, len(text)
    while i < n:
        end = _match_at(text, i, n)
        pieces.append(text[i:end])
        i = end
    return pieces


def _match_at(text: str, i: int, n: int) -> int:
    if text[i] == "'":
        for suffix in ("s", "t", "re", "ve", "m", "ll", "d"):
            if text.startswith(suffix, i + 1):
                return i + 1 + len(suffix)
    j = i + 1 if text[i] == " " else i
    if j < n and _cat(text[j]) in ("L", "N", "o"):
        return _run(text, j, _cat(text[j]))
    k = _run(text, i, "s")
    if k == n or k - 1 == i:
        return k
    return k - 1


@cache
def _reference_data(path: str) -> tuple[dict[str, int], dict[tuple[str, str], int], list[str]]:
    fields = metadata(path)
    tokens = fields["tokenizer.ggml.tokens"]
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(fields["tokenizer.ggml.merges"])}
    specials = [t for t, k in zip(tokens, fields["tokenizer.ggml.token_type"]) if k == 3]
    return {t: i for i, t in enumerate(tokens)}, ranks, specials


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    parts = list(word)
    while len(parts) > 1:
        pairs = [(ranks.get((a, b), 1 << 30), idx) for idx, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, idx = min(pairs)
        if rank == 1 << 30:
            break
        parts[idx:idx + 2] = [parts[idx] + parts[idx + 1]]
    return parts


def _split_specials(text: str, specials: list[str]) -> list[tuple[str, bool]]:
    out, i, start = [], 0, 0
    while i < len(text):
        hit = next((s for s in sorted(specials, key=len, reverse=True) if text.startswith(s, i)), None)
        if hit:
            out += [(text[start:i], False), (hit, True)]
            i += len(hit)
            start = i
        else:
            i += 1
    return out + [(text[start:], False)]


def reference_encode(path: str, text: str) -> list[int]:
    vocab, ranks, specials = _reference_data(path)
    byte_map = _bytes_to_unicode()
    ids: list[int] = []
    for segment, is_special in _split_specials(text, specials):
        if is_special:
            ids.append(vocab[segment])
            continue
        for chunk in _digit_split(segment):
            for piece in _gpt2_pieces(chunk):
                word = "".join(byte_map[b] for b in piece.encode("utf-8"))
                ids += [vocab[p] for p in _bpe(word, ranks)]
    return ids


def _digit_split(text: str) -> list[str]:
    """Digits(individual_digits=True): every numeric character is its own piece."""
    out, current = [], ""
    for ch in text:
        if unicodedata.category(ch)[0] == "N":
            out += [current, ch] if current else [ch]
            current = ""
        else:
            current += ch
    return out + ([current] if current else [])


# --------------------------------------------------------------------------- reference 3: HF directory

def write_hf_copy(gguf_path: Path, directory: Path) -> Path:
    """SmolLM2's tokenizer.json / tokenizer_config.json / config.json, written from the GGUF's data."""
    fields = metadata(gguf_path)
    tokens = fields["tokenizer.ggml.tokens"]
    specials = [(i, t) for i, (t, k) in enumerate(zip(tokens, fields["tokenizer.ggml.token_type"])) if k == 3]
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in specials],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in fields["tokenizer.ggml.merges"]]},
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "chat_template": fields["tokenizer.chat_template"],
        "model_max_length": 8192, "clean_up_tokenization_spaces": False,
    }), encoding="utf-8")
    (directory / "config.json").write_text(json.dumps({
        "max_position_embeddings": 8192, "eos_token_id": 2, "bos_token_id": 1,
    }), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def hf_copy(smollm2_path, tmp_path_factory) -> Path:
    return write_hf_copy(smollm2_path, tmp_path_factory.mktemp("smollm2-hf"))


SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SYSTEM_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
              19712, 8182, 2, 198]
GEN_PROMPT_IDS = [1, 520, 9531, 198]  # <|im_start|>assistant\n


@pytest.mark.parametrize("question, question_ids", [
    ("What is the capital of France? Answer in one sentence.",
     [1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30]),
    ("Quelle est la capitale de la France ? Réponds en une phrase.",
     [65, 2726, 290, 1264, 2618, 47765, 1121, 367, 2618, 4649, 9148, 428, 2756, 96, 19870, 430, 16520, 8715, 30]),
    ("hello world", [28120, 905]),
])
def test_chat_ids_match_published_transformers_ids(smollm2, question, question_ids):
    ids = smollm2.encode_chat([{"role": "user", "content": question}], add_generation_prompt=True)
    assert ids == SYSTEM_IDS + [1, 4093, 198] + question_ids + [2, 198] + GEN_PROMPT_IDS


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_pure_python_bpe(smollm2, smollm2_path, text):
    assert smollm2.encode(text) == reference_encode(str(smollm2_path), text)


@pytest.mark.parametrize("text", CORPUS)
def test_gguf_and_hf_directory_give_identical_ids(smollm2, hf_copy, text):
    reference = Tokenizer.from_file(str(hf_copy / "tokenizer.json"))
    from_dir = load_tokenizer(hf_copy)
    expected = reference.encode(text, add_special_tokens=False).ids
    assert smollm2.encode(text) == expected
    assert from_dir.encode(text) == expected
    assert smollm2.encode(text, add_special_tokens=True) == reference.encode(text).ids


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trips(smollm2, text):
    assert smollm2.decode(smollm2.encode(text)) == text


def test_decode_skips_special_tokens(smollm2):
    ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2.decode(ids, skip_special_tokens=True) == "user\nHi"


def test_metadata_from_gguf(smollm2):
    assert smollm2.eos_token_ids == [2, 0]  # <|im_end|>, then <|endoftext|> (an end-of-generation text)
    assert smollm2.context_length == 8192
    assert (smollm2.bos_token, smollm2.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smollm2.vocab_size == 49152


def test_metadata_from_hf_directory(hf_copy, smollm2):
    from_dir = load_tokenizer(hf_copy)
    assert from_dir.eos_token_ids == [2]
    assert from_dir.context_length == 8192
    assert from_dir.chat_template == smollm2.chat_template


def test_chat_template_system_and_user(smollm2):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert smollm2.render_chat(messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.render_chat(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n")


def test_chat_template_default_system_prompt(smollm2):
    rendered = smollm2.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_raise_exception_in_template_is_a_chat_template_error(smollm2):
    smollm2_strict = pickle.loads(pickle.dumps(smollm2))
    smollm2_strict.chat_template = "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}x"
    with pytest.raises(ChatTemplateError, match="no messages"):
        smollm2_strict.render_chat([])


def test_pickle_round_trip_keeps_everything(smollm2):
    copy = pickle.loads(pickle.dumps(smollm2))
    assert copy.encode(CORPUS[4]) == smollm2.encode(CORPUS[4])
    assert (copy.eos_token_ids, copy.context_length, copy.chat_template) == \
        (smollm2.eos_token_ids, smollm2.context_length, smollm2.chat_template)


def test_to_json_rebuilds_the_same_tokenizer(smollm2):
    rebuilt = Tokenizer.from_str(smollm2.to_json())
    assert rebuilt.encode(CORPUS[2], add_special_tokens=False).ids == smollm2.encode(CORPUS[2])


def test_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)


def test_long_texts_take_the_gil_free_path_with_identical_ids(smollm2, smollm2_path):
    text = "".join(CORPUS) * 8  # well above GIL_FREE_CHARS
    assert smollm2.encode(text) == smollm2.tokenizer.encode(text, add_special_tokens=False).ids
    assert smollm2.encode(text) == reference_encode(str(smollm2_path), text)
