"""The synthetic model generator (``artifacts.synthetic``): valid, deterministic GGUFs with the tensor tables and
quantization a real file of the family has. That llama.cpp loads and runs each one is ``tests/test_arch_matrix.py``'s
job (every builder has a case there)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from artifacts.gguf_layout import read_layout
from artifacts.synthetic import BUILDERS, QUANT_TYPES, Dims, ModelBuilder
from artifacts.synthetic.matrix import MATRIX
from artifacts.synthetic.vocab import build_vocabulary


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_builder_is_exercised_by_the_matrix() -> None:
    assert set(BUILDERS) == {c.arch for c in MATRIX}


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_each_architecture_writes_a_consistent_gguf(arch: str, tmp_path: Path) -> None:
    d = Dims(n_layers=4, n_nextn=1 if arch in ("deepseek2", "glm4", "glm4moe") else 0)
    b = BUILDERS[arch](d, f"t-{arch}")
    layout = read_layout(b.write(tmp_path / "m.gguf", quant="Q8_0"))
    assert layout.architecture == arch and layout.n_layers == 4
    names = [t.name for t in layout.tensors]
    assert len(names) == len(set(names)) == len(b.tensors)
    assert {int(n.split(".")[1]) for n in names if n.startswith("blk.")} == set(range(4))
    assert layout.value("tokenizer.ggml.model") == "llama"
    assert len(layout.value("tokenizer.ggml.tokens")) == b.n_vocab
    for t in layout.tensors:
        spec = next(s for s in b.tensors if s.name == t.name)
        assert t.shape == spec.shape  # GGML order, as llama.cpp's create_tensor lists it
        matrix = spec.kind in ("weight", "embedding") and len(spec.shape) > 1
        if spec.kind == "expert_ids":  # deepseek4's token -> experts table: I32, as llama.cpp reads it
            assert t.ggml_type == GGMLQuantizationType.I32, t.name
        elif not matrix:  # norms, biases, routers, rope factors: F32 as in real files
            assert t.ggml_type == GGMLQuantizationType.F32, t.name
        elif spec.shape[0] % 32 == 0:
            assert t.ggml_type == GGMLQuantizationType.Q8_0, t.name
        else:
            assert t.ggml_type == GGMLQuantizationType.F16, t.name


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    b = BUILDERS["qwen3"](Dims(n_layers=2), "t")
    one, two = b.write(tmp_path / "a.gguf", seed=1), b.write(tmp_path / "b.gguf", seed=1)
    assert sha(one) == sha(two)
    other = b.write(tmp_path / "c.gguf", seed=2)
    assert sha(other) != sha(one)
    assert read_layout(other).tensors == read_layout(one).tensors  # same layout, other values


def test_a_tensor_does_not_depend_on_the_others(tmp_path: Path) -> None:
    small = BUILDERS["llama"](Dims(n_layers=2), "t")
    big = BUILDERS["llama"](Dims(n_layers=4), "t")
    a = {t.name: t for t in GGUFReader(small.write(tmp_path / "a.gguf", seed=3)).tensors}
    b = {t.name: t for t in GGUFReader(big.write(tmp_path / "b.gguf", seed=3)).tensors}
    assert np.array_equal(a["blk.1.attn_q.weight"].data, b["blk.1.attn_q.weight"].data)


@pytest.mark.parametrize("quant", sorted(QUANT_TYPES))
def test_quantization_types(quant: str, tmp_path: Path) -> None:
    layout = read_layout(BUILDERS["llama"](Dims(n_layers=1), "t").write(tmp_path / "m.gguf", quant=quant))
    q = layout.tensors[[t.name for t in layout.tensors].index("blk.0.attn_q.weight")]
    assert q.ggml_type == QUANT_TYPES[quant]
    assert layout.value("general.file_type") == {"F16": 1, "Q8_0": 7, "Q4_0": 2}[quant]
    with pytest.raises(ValueError, match="Q4_K"):
        BUILDERS["llama"](Dims(n_layers=1), "t").write(tmp_path / "x.gguf", quant="Q4_K")


def test_the_vocabulary() -> None:
    v = build_vocabulary()
    assert v.tokens[:4] == ["<unk>", "<s>", "</s>", "<|endoftext|>"]
    assert v.tokens[4:260] == [f"<0x{i:02X}>" for i in range(256)]  # byte fallback: any text tokenizes
    assert len(set(v.tokens)) == v.size == len(v.scores) == len(v.types)
    assert "▁lighthouse" in v.tokens
    padded = build_vocabulary(pad_to=1000)
    assert padded.size == 1000 and padded.tokens[: v.size] == v.tokens


def test_a_key_set_twice_keeps_the_last_value() -> None:
    b = ModelBuilder("llama", "t")
    b.u32("block_count", 2)
    b.u32("block_count", 3)
    assert [m for m in b.metadata if m[0] == "llama.block_count"] == [("llama.block_count", 3, *b.metadata[0][2:])]
