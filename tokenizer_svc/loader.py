"""Load a model's tokenizer: from a GGUF file's metadata or a Hugging Face directory.

    load_tokenizer(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))   # tokenizer.ggml.* + chat template
    load_tokenizer(Path("some-hf-model/"))                    # tokenizer.json + tokenizer_config.json + config.json

Both give a `ModelTokenizer`: the model's vocabulary (llmserve/catalog/vocabulary.py, which the
worker's grammar store loads too: exact token ids, special tokens, EOS ids), the chat template,
the context length, and for the model catalog the architecture and weight format. A
ModelTokenizer pickles as its JSON, so the service loads a model once and ships it to its pool processes cheaply.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from llmserve.catalog import gguf_file
from llmserve.catalog.gguf_metadata import DEFAULT_CONTEXT_LENGTH, read_metadata
from llmserve.catalog.vocabulary import Vocabulary, gguf_vocabulary, hf_vocabulary, read_json
from tokenizer_svc import chat_template, tool_prompt
from tokenizer_svc.literal import LiteralSpecials, encode_ids


@dataclass
class ModelTokenizer:
    """One model's tokenizer, chat template and limits."""

    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    context_length: int = DEFAULT_CONTEXT_LENGTH
    extra_special_tokens: dict[str, str] = field(default_factory=dict)  # unk_token, pad_token ... for templates
    architecture: str = ""      # GGUF general.architecture or config.json model_type ("llama", "gemma3", ...)
    weight_format: str = ""     # "GGUF Q4_K_M", "safetensors bfloat16", ...
    _literal: LiteralSpecials | None = field(default=None, init=False, repr=False, compare=False)

    def encode(self, text: str, add_special_tokens: bool = False, special_tokens_as_text: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text are control tokens (as in HF)
        unless `special_tokens_as_text`: then "<|im_start|>" is encoded as the characters it spells."""
        if special_tokens_as_text:
            return self.literal.encode_text(text, add_special_tokens)
        return encode_ids(self.tokenizer, text, add_special_tokens)

    @property
    def literal(self) -> LiteralSpecials:
        """The special tokens, and a second tokenizer that encodes them as text (built on first use)."""
        if self._literal is None:
            self._literal = LiteralSpecials(self.tokenizer)
        return self._literal

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a conversation (raises ChatTemplateError); `tools` is the template's
        variable of that name (HF's `apply_chat_template(tools=...)`), not given when None."""
        if not self.chat_template:
            raise chat_template.ChatTemplateError("model has no chat template")
        variables: dict[str, Any] = self._template_vars() if tools is None else {**self._template_vars(), "tools": tools}
        return chat_template.render(self.chat_template, messages, add_generation_prompt, variables)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    encode_prompt: Callable[[str], list[int]] | None = None,
                    tools: tuple[tool_prompt.ToolRow, ...] = ()) -> list[int]:
        """Token ids of a conversation: the rendered template, encoded without adding special tokens
        (the template writes them), as `apply_chat_template(tokenize=True)` does, except that special
        tokens written in roles and contents stay text (tokenizer_svc/literal.py).

        Args:
            encode_prompt: how to encode a rendered prompt none of whose messages spells a special
                token (default: encode()); the pool passes its segment-caching encoder.
            tools: the functions the model may call (tokenizer_svc/tool_prompt.py renders them and
                the messages' tool calls and tool turns).
        """
        template_tools = None
        if self.chat_template and tool_prompt.uses_tools(messages, tools):
            messages, template_tools = tool_prompt.prepare(self.chat_template, messages, tools)
            self._refuse_special_tokens(messages, template_tools)
        return self.literal.encode_chat(messages, lambda m: self.render_chat(m, add_generation_prompt, template_tools),
                                        encode_prompt or self.encode)

    def _refuse_special_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """Tool definitions and calls handed to a template's own tool syntax are not contents, which
        literal.py keeps as text: one that spells a special token is refused instead."""
        structured = json.dumps([tools, [m.get("tool_calls") for m in messages]], ensure_ascii=False)
        if self.literal.contains(structured):
            raise chat_template.ChatTemplateError("tools and tool calls must not contain special tokens")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizers JSON (Tokenizer.from_str rebuilds it, e.g. at the gateway for detokenizing)."""
        return self.tokenizer.to_str()

    def _template_vars(self) -> dict[str, str]:
        return {**self.extra_special_tokens, "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}

    def __reduce__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("tokenizer", "_literal")}
        return (_rebuild, (self.to_json(), state))


def _rebuild(tokenizer_json: str, state: dict[str, Any]) -> ModelTokenizer:
    return ModelTokenizer(tokenizer=Tokenizer.from_str(tokenizer_json), **state)


def load_tokenizer(path: Path) -> ModelTokenizer:
    """The tokenizer of a GGUF file or of a Hugging Face model directory.

    Raises:
        FileNotFoundError: no such file, or a directory without tokenizer.json.
        gguf_vocab.UnsupportedTokenizer: a GGUF vocabulary that cannot be reproduced exactly.
    """
    path = Path(path)
    if path.is_dir():
        return load_hf_dir(path)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    return load_gguf(path)


def _model_tokenizer(vocab: Vocabulary, **model: Any) -> ModelTokenizer:
    return ModelTokenizer(tokenizer=vocab.tokenizer, bos_token=vocab.bos_token, eos_token=vocab.eos_token,
                          eos_token_ids=list(vocab.eos_token_ids), extra_special_tokens=vocab.named_tokens, **model)


# ---------------------------------------------------------------------------------------------- GGUF

def load_gguf(path: Path) -> ModelTokenizer:
    fields = gguf_file.metadata(path)
    meta = read_metadata(fields.get)
    return _model_tokenizer(gguf_vocabulary(fields), chat_template=fields.get("tokenizer.chat_template"),
                            context_length=meta.context_length, architecture=meta.architecture,
                            weight_format=meta.weight_format)


# ------------------------------------------------------------------------------------ HF directory

def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = read_json(directory / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        by_name = {t["name"]: t["template"] for t in template}
        return by_name.get("default") or next(iter(by_name.values()), None)
    return template


def _hf_context_length(model_config: dict[str, Any], tok_config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if model_config.get(key):
            return int(model_config[key])
    model_max = tok_config.get("model_max_length")
    return int(model_max) if model_max and model_max < 10**8 else DEFAULT_CONTEXT_LENGTH


def load_hf_dir(directory: Path) -> ModelTokenizer:
    vocab = hf_vocabulary(directory)
    tok_config = read_json(directory / "tokenizer_config.json")
    model_config = read_json(directory / "config.json")
    return _model_tokenizer(vocab, chat_template=_hf_chat_template(directory, tok_config),
                            context_length=_hf_context_length(model_config, tok_config),
                            architecture=model_config.get("model_type", ""),
                            weight_format=_hf_weight_format(model_config))


def _hf_weight_format(model_config: dict[str, Any]) -> str:
    dtype = model_config.get("dtype") or model_config.get("torch_dtype")  # transformers 5.x / 4.x
    return f"safetensors {dtype}" if dtype else "safetensors"
