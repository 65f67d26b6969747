"""A tiny, valid llama-architecture GGUF for fast artifact tests (random weights: llama.cpp loads it, nobody runs it).

Unlike the bundled Gemma (tied output, uniform layers), it can have an ``output.weight`` lm_head, a ``rope_freqs``
tensor shared by every layer, and per-layer metadata arrays, so the shard rules for those cases are exercised.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter


def write_tiny_gguf(path: Path, *, n_layers: int = 4, n_embd: int = 64, n_head: int = 4, n_ff: int = 128,
                    n_vocab: int = 32, tied: bool = False, rope_freqs: bool = True,
                    head_count_kv: list[int] | None = None, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    w.add_uint32("llama.context_length", 256)
    w.add_uint32("llama.embedding_length", n_embd)
    w.add_uint32("llama.block_count", n_layers)
    w.add_uint32("llama.feed_forward_length", n_ff)
    w.add_uint32("llama.attention.head_count", n_head)
    if head_count_kv is None:
        w.add_uint32("llama.attention.head_count_kv", n_head)
    else:
        w.add_key_value("llama.attention.head_count_kv", head_count_kv, GGUFValueType.ARRAY, GGUFValueType.UINT32)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.rope.dimension_count", n_embd // n_head)
    w.add_uint32("general.file_type", 0)
    w.add_string("tokenizer.ggml.model", "llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(n_vocab - 3)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([2, 3, 3] + [1] * (n_vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    add("token_embd.weight", n_vocab, n_embd)
    if rope_freqs:
        add("rope_freqs.weight", n_embd // n_head // 2)
    for il in range(n_layers):
        kv = (head_count_kv[il] if head_count_kv else n_head) * (n_embd // n_head)
        add(f"blk.{il}.attn_norm.weight", n_embd)
        add(f"blk.{il}.attn_q.weight", n_embd, n_embd)
        add(f"blk.{il}.attn_k.weight", kv, n_embd)
        add(f"blk.{il}.attn_v.weight", kv, n_embd)
        add(f"blk.{il}.attn_output.weight", n_embd, n_embd)
        add(f"blk.{il}.ffn_norm.weight", n_embd)
        add(f"blk.{il}.ffn_gate.weight", n_ff, n_embd)
        add(f"blk.{il}.ffn_up.weight", n_ff, n_embd)
        add(f"blk.{il}.ffn_down.weight", n_embd, n_ff)
    add("output_norm.weight", n_embd)
    if not tied:
        add("output.weight", n_vocab, n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_unproven_gguf(path: Path, *, arch: str = "olmo", n_layers: int = 2, n_embd: int = 32) -> Path:
    """A GGUF of an architecture the shard matrix has not proven (``artifacts.arch_support``): enough for the
    manifest, the store, the shard writer and the verifier; llama.cpp is never asked to load it."""
    from artifacts.synthetic.builder import ModelBuilder

    b = ModelBuilder(arch, f"t-{arch}")
    b.u32("block_count", n_layers)
    b.u32("embedding_length", n_embd)
    b.tensor("token_embd.weight", n_embd, b.n_vocab, kind="embedding")
    for il in range(n_layers):
        b.block(il, "attn_q.weight", n_embd, n_embd)
    b.tensor("output_norm.weight", n_embd, kind="norm")
    path.parent.mkdir(parents=True, exist_ok=True)
    return b.write(path)
