"""One GGUF metadata reader: the tokenizer service and the worker report the same context length,
EOS set and BOS for the same file, and the same defaults when the file leaves them out."""

from gpu_worker.model.gguf_loader import read_config
from llmserve.catalog import gguf_file
from llmserve.catalog.gguf_metadata import DEFAULT_CONTEXT_LENGTH, read_metadata
from tokenizer_svc.loader import load_gguf


def test_tokenizer_service_and_worker_agree_on_the_real_gguf(smollm2_path):
    worker = read_config(gguf_file.open_reader(smollm2_path))
    tokenizer = load_gguf(smollm2_path)  # the metadata that reader left (one parse of 3-4 s, not two)
    assert tokenizer.context_length == worker.context_length == 8192
    assert tuple(tokenizer.eos_token_ids) == worker.eos_token_ids
    assert tokenizer.tokenizer.token_to_id(tokenizer.bos_token) == worker.bos_token_id


def test_defaults_and_the_eos_set():
    fields = {"general.architecture": "qwen2", "tokenizer.ggml.eos_token_id": 2,
              "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2}
    meta = read_metadata(fields.get)
    assert (meta.architecture, meta.context_length, meta.eos_token_ids, meta.bos_token_id) == \
        ("qwen2", DEFAULT_CONTEXT_LENGTH, (2, 7), None)
    assert read_metadata({}.get).architecture == "llama"
    assert read_metadata({"llama.context_length": 1024, "tokenizer.ggml.bos_token_id": 1}.get).context_length == 1024


def test_end_of_generation_tokens_join_the_eos_set_and_the_file_type_names_the_format():
    """As llama.cpp: a Llama 3 Instruct file names <|end_of_text|> its EOS, but turns end in <|eot_id|>;
    Gemma's in <end_of_turn>, whatever the keys say."""
    tokens = ["<unk>", "<|end_of_text|>", "<|eot_id|>", "hello", "<end_of_turn>", "<|eom_id|>"]
    fields = {"general.architecture": "llama", "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.eom_token_id": 5, "general.file_type": 15}
    meta = read_metadata(fields.get)
    assert (meta.eos_token_ids, meta.weight_format) == ((1, 5, 2, 4), "GGUF Q4_K_M")
    assert read_metadata({}.get).weight_format == "GGUF"
