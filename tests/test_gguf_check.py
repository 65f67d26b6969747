"""Bad model files are refused with a clear error naming the file, before llama.cpp sees them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from actors.backends.llamacpp.gguf_check import inspect_gguf
from artifacts.gguf_layout import read_layout
from schemas.errors import BackendError, ModelLoadError


def copy_prefix(src: Path, dst: Path, n_bytes: int) -> Path:
    with src.open("rb") as f:
        dst.write_bytes(f.read(n_bytes))
    return dst


def test_the_real_model_passes_and_its_facts_are_read(gemma_path: Path) -> None:
    facts = inspect_gguf(gemma_path)
    layout = read_layout(gemma_path)
    assert facts.size == gemma_path.stat().st_size
    assert facts.architecture == layout.value("general.architecture") == "gemma3"
    assert facts.name == layout.value("general.name")
    assert facts.file_type == "Q4_K_M"  # general.file_type 15 = LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert layout.value("general.file_type") == 15
    assert facts.chat_template is None  # the bundled conversion carries none: the backend falls back
    assert facts.shard is None


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        inspect_gguf(missing)
    assert str(missing) in info.value.message
    assert isinstance(info.value, BackendError)


def test_not_a_gguf(tmp_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("this is a README, not weights\n" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF file") as info:
        inspect_gguf(text)
    assert str(text) in info.value.message
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        inspect_gguf(empty)


def test_truncated_inside_the_tensor_data(gemma_path: Path, tmp_path: Path) -> None:
    layout = read_layout(gemma_path)
    cut = layout.header_size + (gemma_path.stat().st_size - layout.header_size) // 2
    truncated = copy_prefix(gemma_path, tmp_path / "half.gguf", cut)
    with pytest.raises(ModelLoadError, match="truncated") as info:
        inspect_gguf(truncated)
    assert str(truncated) in info.value.message and f"{cut:,} bytes" in info.value.message
    # One byte short is still refused: the check is the exact extent of the tensor data, not a heuristic.
    end = max(t.offset + t.size for t in layout.tensors)
    assert end <= gemma_path.stat().st_size
    sparse = tmp_path / "sparse.gguf"
    copy_prefix(gemma_path, sparse, layout.header_size)
    os.truncate(sparse, end - 1)
    with pytest.raises(ModelLoadError, match="truncated"):
        inspect_gguf(sparse)
    os.truncate(sparse, end)
    assert inspect_gguf(sparse).size == end  # complete extent (zeros inside, which is not this check's job)


def test_truncated_inside_the_header(gemma_path: Path, tmp_path: Path) -> None:
    for n in (10, 4096):
        cut = copy_prefix(gemma_path, tmp_path / f"head-{n}.gguf", n)
        with pytest.raises(ModelLoadError, match="truncated") as info:
            inspect_gguf(cut)
        assert str(cut) in info.value.message
