"""llmserve/catalog/gguf_file.py: a GGUF's metadata is parsed once per process while the file is
unchanged, and read again once it changes."""

import os
from pathlib import Path

import gguf
import pytest

from llmserve.catalog import gguf_file


def write_gguf(path: Path, block_count: int, file_type: int = 3) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    writer.add_file_type(file_type)
    writer.add_token_list(["<s>", "a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def readers_built(monkeypatch) -> list[str]:
    """The paths of the GGUFReaders built from here on."""
    built: list[str] = []
    real = gguf.GGUFReader

    def counting(path, *args, **kwargs):
        built.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    return built


def test_metadata_comes_from_the_reader_already_built(tmp_path, readers_built):
    path = write_gguf(tmp_path / "m.gguf", block_count=2)
    reader = gguf_file.open_reader(path)
    assert [t.name for t in reader.tensors] == []
    fields = gguf_file.metadata(path)
    assert gguf_file.metadata(str(path)) is fields
    assert readers_built == [str(path)]
    assert (fields["llama.block_count"], fields["general.file_type"], fields["tokenizer.ggml.tokens"]) == \
        (2, 3, ["<s>", "a", "b"])
    assert not any(key.startswith("GGUF.") for key in fields)
    with pytest.raises(TypeError):
        fields["llama.block_count"] = 3  # type: ignore[index]


def test_a_changed_file_is_read_again(tmp_path, readers_built):
    path = write_gguf(tmp_path / "m.gguf", block_count=2)
    assert gguf_file.metadata(path)["llama.block_count"] == 2
    write_gguf(tmp_path / "next.gguf", block_count=7)
    os.replace(tmp_path / "next.gguf", path)              # a new file at the same path
    assert gguf_file.metadata(path)["llama.block_count"] == 7
    assert len(readers_built) == 2


def test_only_the_last_files_are_kept(tmp_path, readers_built):
    paths = [write_gguf(tmp_path / f"m{i}.gguf", block_count=i + 1) for i in range(gguf_file.KEEP + 1)]
    for path in paths:
        gguf_file.metadata(path)
    assert gguf_file.metadata(paths[-1])["llama.block_count"] == gguf_file.KEEP + 1
    assert len(readers_built) == gguf_file.KEEP + 1
    assert gguf_file.metadata(paths[0])["llama.block_count"] == 1    # forgotten: read again
    assert len(readers_built) == gguf_file.KEEP + 2


def test_a_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        gguf_file.metadata(tmp_path / "absent.gguf")


def test_a_reader_passed_on_goes_to_the_next_opener_once(tmp_path, readers_built):
    path = write_gguf(tmp_path / "m.gguf", block_count=2)
    checked = gguf_file.open_reader(path, pass_on=True)
    assert gguf_file.open_reader(path) is checked
    assert len(readers_built) == 1
    assert gguf_file.open_reader(path) is not checked          # handed out once, then a new one
    assert len(readers_built) == 2


def test_a_reader_let_go_or_of_a_changed_file_is_not_handed_out(tmp_path, readers_built):
    path = write_gguf(tmp_path / "m.gguf", block_count=2)
    checked = gguf_file.open_reader(path, pass_on=True)
    gguf_file.let_go(path)
    assert gguf_file.open_reader(path) is not checked
    gguf_file.open_reader(path, pass_on=True)
    write_gguf(tmp_path / "next.gguf", block_count=7)
    os.replace(tmp_path / "next.gguf", path)
    gguf_file.open_reader(path)
    assert gguf_file.metadata(path)["llama.block_count"] == 7
    assert len(readers_built) == 4
