"""Tensor tables and metadata of tiny models, one function per llama.cpp architecture.

Each table is transcribed from the vendored llama.cpp (commit 0c1e57098): ``load_arch_hparams`` for the keys and
``load_arch_tensors`` for the tensors and their shapes (GGML order, as ``create_tensor`` lists them), in
``src/models/<file>.cpp`` (file named next to each function). Optional tensors a real GGUF of the family carries are
included (qwen2's q/k/v biases, llama 3's ``rope_freqs``, phi3's long/short rope factors) so their code paths run.
The keys mirror what ``convert_hf_to_gguf.py`` writes for the family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gguf import GGUFValueType

from artifacts.synthetic.builder import ModelBuilder
from artifacts.synthetic.vocab import build_vocabulary


@dataclasses.dataclass(frozen=True)
class Dims:
    """Sizes of a tiny model. Every dimension that is a row length (``ne0``) of a matrix is a multiple of 32, so
    Q8_0/Q4_0 quantize every matrix as in a real file."""

    n_layers: int = 6
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 96
    n_ctx: int = 512
    sliding_window: int = 16
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_expert_shared: int = 1
    n_dense_lead: int = 1
    n_nextn: int = 1
    q_lora_rank: int = 32
    """0 builds a "lite" deepseek2 (plain attn_q, no q LoRA)."""
    kv_lora_rank: int = 32
    qk_rope_dim: int = 16
    qk_nope_dim: int = 32
    v_head_dim: int = 32
    vocab_pad_to: int = 0
    """Pad the vocabulary to this many tokens (llama.cpp keys some settings on the vocabulary size)."""
    llama_moe: bool = False
    """llama with routed experts in every layer (Mixtral's layout: experts of ``n_ff``)."""
    expert_gating_func: int | None = 2
    """deepseek2/glm4moe ``expert_gating_func`` (1 softmax, 2 sigmoid); None leaves the key out."""
    compress_ratios: tuple[int, ...] = ()
    """deepseek4: per trunk layer 0 (sliding window only), 4 (CSA + lightning indexer) or 128 (HCA); the MTP
    blocks slide."""
    n_hash: int = 3
    """deepseek4: leading layers that route experts by token id (``ffn_gate_tid2eid``)."""
    hc_mult: int = 4
    """deepseek4: hyper-connection residual streams (llama.cpp asserts 4)."""
    o_groups: int = 2
    o_lora_rank: int = 32
    indexer_heads: int = 4
    indexer_head_dim: int = 32
    indexer_top_k: int = 16

    @property
    def n_trunk(self) -> int:
        return self.n_layers - self.n_nextn


ArchBuilder = Callable[[Dims, str], ModelBuilder]


def _start(arch: str, d: Dims, name: str) -> ModelBuilder:
    b = ModelBuilder(arch, name, vocab=build_vocabulary(d.vocab_pad_to))
    b.u32("context_length", d.n_ctx)
    b.u32("embedding_length", d.n_embd)
    b.u32("block_count", d.n_layers)
    b.u32("feed_forward_length", d.n_ff)
    b.u32("attention.head_count", d.n_head)
    b.u32("attention.head_count_kv", d.n_head_kv)
    b.f32("attention.layer_norm_rms_epsilon", 1e-6)
    b.f32("rope.freq_base", 10000.0)
    return b


def _head_dims(b: ModelBuilder, d: Dims) -> None:
    b.u32("attention.key_length", d.head_dim)
    b.u32("attention.value_length", d.head_dim)
    b.u32("rope.dimension_count", d.head_dim)


def _attention(b: ModelBuilder, d: Dims, il: int, *, bias: bool = False) -> None:
    q, kv = d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    b.block(il, "attn_norm.weight", d.n_embd, kind="norm")
    b.block(il, "attn_q.weight", d.n_embd, q)
    b.block(il, "attn_k.weight", d.n_embd, kv)
    b.block(il, "attn_v.weight", d.n_embd, kv)
    if bias:
        b.block(il, "attn_q.bias", q, kind="bias")
        b.block(il, "attn_k.bias", kv, kind="bias")
        b.block(il, "attn_v.bias", kv, kind="bias")
    b.block(il, "attn_output.weight", q, d.n_embd)


def _qk_norm(b: ModelBuilder, d: Dims, il: int) -> None:
    b.block(il, "attn_q_norm.weight", d.head_dim, kind="norm")
    b.block(il, "attn_k_norm.weight", d.head_dim, kind="norm")


def _dense_ffn(b: ModelBuilder, d: Dims, il: int, n_ff: int | None = None) -> None:
    ff = n_ff or d.n_ff
    b.block(il, "ffn_gate.weight", d.n_embd, ff)
    b.block(il, "ffn_up.weight", d.n_embd, ff)
    b.block(il, "ffn_down.weight", ff, d.n_embd)


def _experts(b: ModelBuilder, d: Dims, il: int) -> None:
    b.block(il, "ffn_gate_inp.weight", d.n_embd, d.n_expert, kind="router")
    b.block(il, "ffn_gate_exps.weight", d.n_embd, d.n_ff_exp, d.n_expert)
    b.block(il, "ffn_down_exps.weight", d.n_ff_exp, d.n_embd, d.n_expert)
    b.block(il, "ffn_up_exps.weight", d.n_embd, d.n_ff_exp, d.n_expert)


def _shared_expert(b: ModelBuilder, d: Dims, il: int) -> None:
    ff = d.n_ff_exp * d.n_expert_shared
    b.block(il, "ffn_gate_shexp.weight", d.n_embd, ff)
    b.block(il, "ffn_down_shexp.weight", ff, d.n_embd)
    b.block(il, "ffn_up_shexp.weight", d.n_embd, ff)


def _nextn(b: ModelBuilder, d: Dims, il: int) -> None:
    b.block(il, "nextn.eh_proj.weight", 2 * d.n_embd, d.n_embd)
    b.block(il, "nextn.enorm.weight", d.n_embd, kind="norm")
    b.block(il, "nextn.hnorm.weight", d.n_embd, kind="norm")
    b.block(il, "nextn.shared_head_norm.weight", d.n_embd, kind="norm")


def _moe_keys(b: ModelBuilder, d: Dims) -> None:
    b.u32("expert_count", d.n_expert)
    b.u32("expert_used_count", d.n_expert_used)
    b.u32("expert_feed_forward_length", d.n_ff_exp)


def _output(b: ModelBuilder, d: Dims, *, tied: bool) -> None:
    b.tensor("output_norm.weight", d.n_embd, kind="norm")
    if not tied:
        b.tensor("output.weight", d.n_embd, b.n_vocab)


def llama(d: Dims, name: str) -> ModelBuilder:
    """models/llama.cpp (Llama 3.x; Mistral 7B / Nemo / Mixtral GGUFs use this architecture too): GQA, llama 3
    rope_freqs; with ``llama_moe`` every layer routes to experts as Mixtral does."""
    b = _start("llama", d, name)
    b.u32("rope.dimension_count", d.n_embd // d.n_head)
    b.u32("vocab_size", b.n_vocab)
    if d.llama_moe:
        b.u32("expert_count", d.n_expert)
        b.u32("expert_used_count", d.n_expert_used)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    b.tensor("rope_freqs.weight", d.n_embd // d.n_head // 2, kind="positive")
    hd = dataclasses.replace(d, head_dim=d.n_embd // d.n_head)
    for il in range(d.n_layers):
        _attention(b, hd, il)
        b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
        if d.llama_moe:
            _experts(b, dataclasses.replace(d, n_ff_exp=d.n_ff), il)
        else:
            _dense_ffn(b, d, il)
    _output(b, d, tied=False)
    return b


def mistral3(d: Dims, name: str) -> ModelBuilder:
    """models/mistral3.cpp (Mistral Small 3.x / Ministral): llama layers plus position-dependent attention
    temperature scaling (``attention.temperature_scale``, floor at ``rope.scaling.original_context_length``)."""
    b = _start("mistral3", d, name)
    b.u32("rope.dimension_count", d.n_embd // d.n_head)
    b.f32("attention.temperature_scale", 0.1)
    b.u32("rope.scaling.original_context_length", 16)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    hd = dataclasses.replace(d, head_dim=d.n_embd // d.n_head)
    for il in range(d.n_layers):
        _attention(b, hd, il)
        b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
        _dense_ffn(b, d, il)
    _output(b, d, tied=False)
    return b


def qwen2(d: Dims, name: str) -> ModelBuilder:
    """models/qwen2.cpp (Qwen 2 / 2.5): q/k/v biases, tied output like the small Qwen 2.5 models."""
    b = _start("qwen2", d, name)
    hd = dataclasses.replace(d, head_dim=d.n_embd // d.n_head)
    b.u32("rope.dimension_count", hd.head_dim)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    for il in range(d.n_layers):
        _attention(b, hd, il, bias=True)
        b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
        _dense_ffn(b, d, il)
    _output(b, d, tied=True)
    return b


def qwen3(d: Dims, name: str) -> ModelBuilder:
    """models/qwen3.cpp: q/k RMS norms, head_dim independent of n_embd / n_head."""
    b = _start("qwen3", d, name)
    _head_dims(b, d)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    for il in range(d.n_layers):
        _attention(b, d, il)
        _qk_norm(b, d, il)
        b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
        _dense_ffn(b, d, il)
    _output(b, d, tied=False)
    return b


def qwen3moe(d: Dims, name: str) -> ModelBuilder:
    """models/qwen3moe.cpp: every layer a routed mixture of experts (no shared expert), q/k norms."""
    b = _start("qwen3moe", d, name)
    _head_dims(b, d)
    _moe_keys(b, d)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    for il in range(d.n_layers):
        _attention(b, d, il)
        _qk_norm(b, d, il)
        b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
        _experts(b, d, il)
    _output(b, d, tied=False)
    return b


def phi3(d: Dims, name: str) -> ModelBuilder:
    """models/phi3.cpp (Phi-3 / 3.5 / 4-mini): fused qkv, fused gate+up (``ffn_up`` of 2 * n_ff), LongRoPE factors
    (``rope_factors_long``/``_short``, chosen by context size), a sliding window key that llama.cpp disables."""
    b = _start("phi3", d, name)
    hd = d.n_embd // d.n_head
    b.u32("rope.dimension_count", hd)
    b.u32("rope.scaling.original_context_length", 64)
    b.f32("rope.scaling.attn_factor", 1.19)
    b.u32("attention.sliding_window", 32)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    b.tensor("rope_factors_long.weight", hd // 2, kind="positive")
    b.tensor("rope_factors_short.weight", hd // 2, kind="positive")
    for il in range(d.n_layers):
        b.block(il, "attn_norm.weight", d.n_embd, kind="norm")
        b.block(il, "attn_qkv.weight", d.n_embd, d.n_embd + 2 * d.n_head_kv * hd)
        b.block(il, "attn_output.weight", d.n_embd, d.n_embd)
        b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
        b.block(il, "ffn_down.weight", d.n_ff, d.n_embd)
        b.block(il, "ffn_up.weight", d.n_embd, 2 * d.n_ff)
    _output(b, d, tied=False)
    return b


def _gemma_layer(b: ModelBuilder, d: Dims, il: int, *, qk_norm: bool) -> None:
    _attention(b, d, il)
    b.block(il, "post_attention_norm.weight", d.n_embd, kind="norm")
    if qk_norm:
        _qk_norm(b, d, il)
    b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
    _dense_ffn(b, d, il)
    b.block(il, "post_ffw_norm.weight", d.n_embd, kind="norm")


def gemma2(d: Dims, name: str) -> ModelBuilder:
    """models/gemma2.cpp: sliding/global alternation (pattern 2), attention and final logit soft-capping, tied."""
    b = _start("gemma2", d, name)
    _head_dims(b, d)
    b.u32("attention.sliding_window", d.sliding_window)
    b.f32("attn_logit_softcapping", 50.0)
    b.f32("final_logit_softcapping", 30.0)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    for il in range(d.n_layers):
        _gemma_layer(b, d, il, qk_norm=False)
    _output(b, d, tied=True)
    return b


def gemma3(d: Dims, name: str) -> ModelBuilder:
    """models/gemma3.cpp: 5 sliding layers then 1 global (pattern 6), a separate RoPE base for sliding layers, q/k
    norms, tied output. With 62 layers llama.cpp takes it for Gemma 3 27B and changes the attention scale."""
    b = _start("gemma3", d, name)
    _head_dims(b, d)
    b.u32("attention.sliding_window", d.sliding_window)
    b.f32("rope.freq_base_swa", 1000.0)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    for il in range(d.n_layers):
        _gemma_layer(b, d, il, qk_norm=True)
    _output(b, d, tied=True)
    return b


def gpt_oss(d: Dims, name: str) -> ModelBuilder:
    """models/openai-moe.cpp (gpt-oss): sliding/global alternation (pattern 2), attention sinks, biased experts
    with the clamped SwiGLU, YaRN RoPE scaling, untied output."""
    b = _start("gpt-oss", d, name)
    _head_dims(b, d)
    _moe_keys(b, d)
    b.u32("attention.sliding_window", d.sliding_window)
    b.string("rope.scaling.type", "yarn")
    b.f32("rope.scaling.factor", 4.0)
    b.u32("rope.scaling.original_context_length", 128)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    q, kv = d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    for il in range(d.n_layers):
        b.block(il, "attn_norm.weight", d.n_embd, kind="norm")
        b.block(il, "post_attention_norm.weight", d.n_embd, kind="norm")
        b.block(il, "attn_q.weight", d.n_embd, q)
        b.block(il, "attn_k.weight", d.n_embd, kv)
        b.block(il, "attn_v.weight", d.n_embd, kv)
        b.block(il, "attn_q.bias", q, kind="bias")
        b.block(il, "attn_k.bias", kv, kind="bias")
        b.block(il, "attn_v.bias", kv, kind="bias")
        b.block(il, "attn_output.weight", q, d.n_embd)
        b.block(il, "attn_output.bias", d.n_embd, kind="bias")
        b.block(il, "attn_sinks.weight", d.n_head, kind="small")
        _experts(b, d, il)
        b.block(il, "ffn_gate_inp.bias", d.n_expert, kind="bias")
        b.block(il, "ffn_gate_exps.bias", d.n_ff_exp, d.n_expert, kind="bias")
        b.block(il, "ffn_down_exps.bias", d.n_embd, d.n_expert, kind="bias")
        b.block(il, "ffn_up_exps.bias", d.n_ff_exp, d.n_expert, kind="bias")
    _output(b, d, tied=False)
    return b


def deepseek2(d: Dims, name: str) -> ModelBuilder:
    """models/deepseek2.cpp (DeepSeek V2/V3/R1, Kimi K2, GLM-4.7-Flash...): multi-head latent attention with a
    q LoRA, ``leading_dense_block_count`` dense layers then MoE layers with a shared expert, sigmoid routing with a
    per-expert bias and expert groups, trailing next-token-prediction (MTP) layers, YaRN RoPE."""
    b = _start("deepseek2", d, name)
    b.u32("attention.head_count_kv", 1)  # MLA: one latent KV "head"
    b.u32("vocab_size", b.n_vocab)
    b.u32("leading_dense_block_count", d.n_dense_lead)
    b.u32("nextn_predict_layers", d.n_nextn)
    if d.q_lora_rank:
        b.u32("attention.q_lora_rank", d.q_lora_rank)
    b.u32("attention.kv_lora_rank", d.kv_lora_rank)
    b.u32("attention.key_length", d.kv_lora_rank + d.qk_rope_dim)
    b.u32("attention.value_length", d.kv_lora_rank)
    b.u32("attention.key_length_mla", d.qk_nope_dim + d.qk_rope_dim)
    b.u32("attention.value_length_mla", d.v_head_dim)
    b.u32("rope.dimension_count", d.qk_rope_dim)
    _moe_keys(b, d)
    b.u32("expert_shared_count", d.n_expert_shared)
    b.u32("expert_group_count", 4)
    b.u32("expert_group_used_count", 2)
    b.f32("expert_weights_scale", 2.5)
    b.boolean("expert_weights_norm", True)
    if d.expert_gating_func is not None:
        b.u32("expert_gating_func", d.expert_gating_func)
    b.string("rope.scaling.type", "yarn")
    b.f32("rope.scaling.factor", 4.0)
    b.u32("rope.scaling.original_context_length", 128)
    b.f32("rope.scaling.yarn_log_multiplier", 0.1)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    k_mla = d.qk_nope_dim + d.qk_rope_dim
    for il in range(d.n_layers):
        b.block(il, "attn_norm.weight", d.n_embd, kind="norm")
        if d.q_lora_rank:
            b.block(il, "attn_q_a_norm.weight", d.q_lora_rank, kind="norm")
        b.block(il, "attn_kv_a_norm.weight", d.kv_lora_rank, kind="norm")
        if d.q_lora_rank:
            b.block(il, "attn_q_a.weight", d.n_embd, d.q_lora_rank)
            b.block(il, "attn_q_b.weight", d.q_lora_rank, d.n_head * k_mla)
        else:  # "lite" models (DeepSeek-V2-Lite): a plain query projection
            b.block(il, "attn_q.weight", d.n_embd, d.n_head * k_mla)
        b.block(il, "attn_kv_a_mqa.weight", d.n_embd, d.kv_lora_rank + d.qk_rope_dim)
        b.block(il, "attn_k_b.weight", d.qk_nope_dim, d.kv_lora_rank, d.n_head)
        b.block(il, "attn_v_b.weight", d.kv_lora_rank, d.v_head_dim, d.n_head)
        b.block(il, "attn_output.weight", d.n_head * d.v_head_dim, d.n_embd)
        b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
        if il < d.n_dense_lead:
            _dense_ffn(b, d, il)
        else:
            _experts(b, d, il)
            b.block(il, "exp_probs_b.bias", d.n_expert, kind="small")
            _shared_expert(b, d, il)
        if il >= d.n_trunk:
            _nextn(b, d, il)
    _output(b, d, tied=False)
    return b


def glm4(d: Dims, name: str) -> ModelBuilder:
    """models/glm4.cpp (GLM-4 9B/32B 0414): fused gate+up, post-attention and post-FFN norms, trailing NextN
    layers kept but unused."""
    b = _start("glm4", d, name)
    hd = dataclasses.replace(d, head_dim=d.n_embd // d.n_head)
    b.u32("rope.dimension_count", hd.head_dim)
    b.u32("nextn_predict_layers", d.n_nextn)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    for il in range(d.n_layers):
        _attention(b, hd, il, bias=True)
        b.block(il, "post_attention_norm.weight", d.n_embd, kind="norm")
        b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
        b.block(il, "ffn_down.weight", d.n_ff, d.n_embd)
        b.block(il, "ffn_up.weight", d.n_embd, 2 * d.n_ff)
        b.block(il, "post_ffw_norm.weight", d.n_embd, kind="norm")
        if il >= d.n_trunk:
            _nextn(b, d, il)
    _output(b, d, tied=False)
    return b


def glm4moe(d: Dims, name: str) -> ModelBuilder:
    """models/glm4-moe.cpp (GLM-4.5 / 4.6 / 4.7): dense leading layers then sigmoid-routed MoE with a shared
    expert, q/k norms, trailing MTP layers."""
    b = _start("glm4moe", d, name)
    _head_dims(b, d)
    b.u32("rope.dimension_count", d.head_dim // 2)  # GLM-4.5 rotates half of each head
    _moe_keys(b, d)
    b.u32("expert_shared_count", d.n_expert_shared)
    b.u32("leading_dense_block_count", d.n_dense_lead)
    b.u32("nextn_predict_layers", d.n_nextn)
    b.f32("expert_weights_scale", 1.0)
    b.boolean("expert_weights_norm", True)
    if d.expert_gating_func is not None:
        b.u32("expert_gating_func", d.expert_gating_func)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    for il in range(d.n_layers):
        _attention(b, d, il, bias=True)
        _qk_norm(b, d, il)
        b.block(il, "post_attention_norm.weight", d.n_embd, kind="norm")
        if il < d.n_dense_lead:
            _dense_ffn(b, d, il)
        else:
            _experts(b, d, il)
            b.block(il, "exp_probs_b.bias", d.n_expert, kind="small")
            _shared_expert(b, d, il)
        if il >= d.n_trunk:
            _nextn(b, d, il)
    _output(b, d, tied=False)
    return b


def _v4_attention(b: ModelBuilder, d: Dims, il: int, ratio: int) -> None:
    """One deepseek4 layer's attention: q LoRA, one shared K=V head, grouped low-rank output, sinks, and the
    compressor (plus the lightning indexer at ratio 4) of a compressed layer."""
    hd = d.head_dim
    b.block(il, "attn_norm.weight", d.n_embd, kind="norm")
    b.block(il, "attn_sinks.weight", d.n_head, kind="small")
    b.block(il, "attn_q_a.weight", d.n_embd, d.q_lora_rank)
    b.block(il, "attn_q_a_norm.weight", d.q_lora_rank, kind="norm")
    b.block(il, "attn_q_b.weight", d.q_lora_rank, d.n_head * hd)
    b.block(il, "attn_kv.weight", d.n_embd, hd)
    b.block(il, "attn_kv_a_norm.weight", hd, kind="norm")
    # As the converter writes it: (n_head * head_dim / groups, o_lora_rank * groups); llama.cpp reshapes on load.
    b.block(il, "attn_output_a.weight", d.n_head * hd // d.o_groups, d.o_lora_rank * d.o_groups)
    b.block(il, "attn_output_b.weight", d.o_groups * d.o_lora_rank, d.n_embd)
    if not ratio:
        return
    coff = 2 if ratio == 4 else 1  # CSA blocks overlap: two rows per position
    b.block(il, "attn_compressor_kv.weight", d.n_embd, coff * hd)
    b.block(il, "attn_compressor_gate.weight", d.n_embd, coff * hd)
    b.block(il, "attn_compressor_ape.weight", coff * hd, ratio, kind="small")
    b.block(il, "attn_compressor_norm.weight", hd, kind="norm")
    if ratio == 4:
        ih = d.indexer_head_dim
        b.block(il, "indexer.proj.weight", d.n_embd, d.indexer_heads, kind="router")
        b.block(il, "indexer.attn_q_b.weight", d.q_lora_rank, d.indexer_heads * ih)
        b.block(il, "indexer_compressor_kv.weight", d.n_embd, 2 * ih)
        b.block(il, "indexer_compressor_gate.weight", d.n_embd, 2 * ih)
        b.block(il, "indexer_compressor_ape.weight", 2 * ih, ratio, kind="small")
        b.block(il, "indexer_compressor_norm.weight", ih, kind="norm")


def _v4_hyper_connections(b: ModelBuilder, d: Dims, il: int) -> None:
    hc_dim, mix = d.hc_mult * d.n_embd, (2 + d.hc_mult) * d.hc_mult
    for part in ("attn", "ffn"):
        b.block(il, f"hc_{part}_fn.weight", hc_dim, mix, kind="router")
        b.block(il, f"hc_{part}_base.weight", mix, kind="small")
        b.block(il, f"hc_{part}_scale.weight", 3, kind="small")


def _v4_moe(b: ModelBuilder, d: Dims, il: int) -> None:
    if il < d.n_hash:
        b.block(il, "ffn_gate_tid2eid.weight", d.n_expert_used, b.n_vocab, kind="expert_ids", bound=d.n_expert)
    else:
        b.block(il, "exp_probs_b.bias", d.n_expert, kind="small")
    b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
    _experts(b, d, il)
    _shared_expert(b, d, il)


def _v4_flash_ratios(n_trunk: int) -> list[int]:
    """V4-Flash's schedule cut to ``n_trunk`` layers: two sliding-only layers, CSA/HCA alternating, a CSA layer
    last (``[0, 0] + [4, 128] x 20 + [4]`` for its 43)."""
    ratios = [0 if il < 2 else (4 if il % 2 == 0 else 128) for il in range(n_trunk)]
    if n_trunk > 2:
        ratios[-1] = 4
    return ratios


def deepseek4(d: Dims, name: str) -> ModelBuilder:
    """models/deepseek4.cpp (DeepSeek V4 Flash / Pro): ``hc_mult`` hyper-connection residual streams mixed by
    Sinkhorn-normalised matrices around every sublayer, a 128-position sliding window in every layer plus, per
    ``compress_ratios``, CSA (ratio 4, lightning-indexer top-k) or HCA (ratio 128) compressed KV, sqrt-softplus
    routed experts with a shared one, the first ``n_hash`` layers routing by token id, trailing MTP blocks, YaRN."""
    b = _start("deepseek4", d, name)
    ratios = list(d.compress_ratios or _v4_flash_ratios(d.n_trunk)) + [0] * d.n_nextn
    if len(ratios) != d.n_layers:
        raise ValueError(f"deepseek4 needs one compress ratio per trunk layer ({d.n_trunk}), got {d.compress_ratios}")
    b.u32("vocab_size", b.n_vocab)
    b.u32("attention.head_count_kv", 1)
    b.u32("attention.key_length", d.head_dim)
    b.u32("attention.value_length", d.head_dim)
    b.u32("rope.dimension_count", d.qk_rope_dim)
    b.u32("attention.q_lora_rank", d.q_lora_rank)
    b.u32("attention.sliding_window", d.sliding_window)
    b.u32("attention.output_group_count", d.o_groups)
    b.u32("attention.output_lora_rank", d.o_lora_rank)
    b.f32("attention.compress_rope_freq_base", 160000.0)
    b.array("attention.compress_ratios", ratios, GGUFValueType.UINT32)
    b.u32("attention.indexer.head_count", d.indexer_heads)
    b.u32("attention.indexer.key_length", d.indexer_head_dim)
    b.u32("attention.indexer.top_k", d.indexer_top_k)
    b.u32("nextn_predict_layers", d.n_nextn)
    _moe_keys(b, d)
    b.u32("expert_shared_count", d.n_expert_shared)
    b.f32("expert_weights_scale", 1.5)
    b.boolean("expert_weights_norm", True)
    b.u32("expert_gating_func", 4)  # sqrt(softplus): the only scoring the loader accepts
    b.array("swiglu_clamp_exp", [10.0] * d.n_layers, GGUFValueType.FLOAT32)
    b.u32("hyper_connection.count", d.hc_mult)
    b.u32("hyper_connection.sinkhorn_iterations", 20)
    b.f32("hyper_connection.epsilon", 1e-6)
    b.u32("hash_layer_count", d.n_hash)
    b.string("rope.scaling.type", "yarn")
    b.f32("rope.scaling.factor", 4.0)
    b.u32("rope.scaling.original_context_length", 128)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    hc_dim = d.hc_mult * d.n_embd
    b.tensor("output_hc_fn.weight", hc_dim, d.hc_mult, kind="router")
    b.tensor("output_hc_base.weight", d.hc_mult, kind="small")
    b.tensor("output_hc_scale.weight", 1, kind="small")
    for il in range(d.n_layers):
        _v4_attention(b, d, il, ratios[il])
        _v4_hyper_connections(b, d, il)
        _v4_moe(b, d, il)
        if il >= d.n_trunk:
            _nextn(b, d, il)
    _output(b, d, tied=False)
    return b


def qwen35moe(d: Dims, name: str) -> ModelBuilder:
    """models/qwen35moe.cpp (Qwen 3.5/3.6 MoE, Ornith-class): every ``full_attention_interval``-th layer is gated
    full attention (query and gate in one projection, q/k norms, interleaved M-RoPE), the others Gated DeltaNet
    linear attention (fused qkv, z gate, a causal conv1d and a recurrent per-head state); every layer a routed MoE
    plus a gated shared expert; a post-attention norm."""
    b = _start("qwen35moe", d, name)
    _head_dims(b, d)
    b.u32("rope.dimension_count", d.head_dim // 2)  # partial rotary, as the 35B-A3B (64 of 256)
    b.array("rope.dimension_sections", [2, 1, 1, 0], GGUFValueType.INT32)
    _moe_keys(b, d)
    b.u32("expert_shared_feed_forward_length", d.n_ff_exp)
    b.u32("full_attention_interval", 4)
    # Gated DeltaNet: n_k_heads (group count) x state, n_v_heads (time-step rank) x state.
    b.u32("ssm.conv_kernel", 4)
    b.u32("ssm.state_size", _DN_STATE)
    b.u32("ssm.group_count", _DN_K_HEADS)
    b.u32("ssm.time_step_rank", _DN_V_HEADS)
    b.u32("ssm.inner_size", _DN_STATE * _DN_V_HEADS)
    key_dim, value_dim = _DN_STATE * _DN_K_HEADS, _DN_STATE * _DN_V_HEADS
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    for il in range(d.n_layers):
        b.block(il, "attn_norm.weight", d.n_embd, kind="norm")
        b.block(il, "post_attention_norm.weight", d.n_embd, kind="norm")
        if (il + 1) % 4:
            b.block(il, "attn_qkv.weight", d.n_embd, 2 * key_dim + value_dim)
            b.block(il, "attn_gate.weight", d.n_embd, value_dim)
            b.block(il, "ssm_conv1d.weight", 4, 2 * key_dim + value_dim, kind="small")
            b.block(il, "ssm_dt.bias", _DN_V_HEADS, kind="small")
            b.block(il, "ssm_a", _DN_V_HEADS, kind="negative")  # -exp(A_log): the state decays
            b.block(il, "ssm_beta.weight", d.n_embd, _DN_V_HEADS)
            b.block(il, "ssm_alpha.weight", d.n_embd, _DN_V_HEADS)
            b.block(il, "ssm_norm.weight", _DN_STATE, kind="norm")
            b.block(il, "ssm_out.weight", value_dim, d.n_embd)
        else:
            q, kv = d.n_head * d.head_dim, d.n_head_kv * d.head_dim
            b.block(il, "attn_q.weight", d.n_embd, 2 * q)
            b.block(il, "attn_k.weight", d.n_embd, kv)
            b.block(il, "attn_v.weight", d.n_embd, kv)
            b.block(il, "attn_output.weight", q, d.n_embd)
            _qk_norm(b, d, il)
        _experts(b, d, il)
        b.block(il, "ffn_gate_inp_shexp.weight", d.n_embd, kind="small")
        _shared_expert(b, d, il)
    _output(b, d, tied=False)
    return b


_DN_STATE, _DN_K_HEADS, _DN_V_HEADS = 32, 2, 4
"""Gated DeltaNet widths of the tiny qwen35moe: head width 32 (128 in the 35B-A3B), 2 key heads, 4 value heads."""


def glm_dsa(d: Dims, name: str) -> ModelBuilder:
    """models/glm-dsa.cpp (GLM-5 / 5.1 / 5.2): deepseek2's multi-head latent attention with a q LoRA plus a DSA
    lightning indexer (top-k key selection, Hadamard-rotated keys in their own cache); per
    ``attention.indexer.types`` a layer runs its own indexer (1) or reuses the previous layer's top-k (0, GLM-5.2's
    "IndexShare"); dense leading layers, sigmoid-routed MoE with a shared expert, one trailing MTP block."""
    b = _start("glm-dsa", d, name)
    b.u32("attention.head_count_kv", 1)
    b.u32("leading_dense_block_count", d.n_dense_lead)
    b.u32("nextn_predict_layers", d.n_nextn)
    b.u32("attention.q_lora_rank", d.q_lora_rank)
    b.u32("attention.kv_lora_rank", d.kv_lora_rank)
    b.u32("attention.key_length", d.kv_lora_rank + d.qk_rope_dim)
    b.u32("attention.value_length", d.kv_lora_rank)
    b.u32("attention.key_length_mla", d.qk_nope_dim + d.qk_rope_dim)
    b.u32("attention.value_length_mla", d.v_head_dim)
    b.u32("rope.dimension_count", d.qk_rope_dim)
    b.u32("attention.indexer.head_count", d.indexer_heads)
    b.u32("attention.indexer.key_length", d.indexer_head_dim)
    b.u32("attention.indexer.top_k", d.indexer_top_k)
    full = _glm52_indexer_types(d.n_trunk)
    b.array("attention.indexer.types", full, GGUFValueType.UINT32)
    _moe_keys(b, d)
    b.u32("expert_shared_count", d.n_expert_shared)
    b.f32("expert_weights_scale", 2.5)
    b.boolean("expert_weights_norm", True)
    b.u32("expert_gating_func", 2)
    b.tensor("token_embd.weight", d.n_embd, b.n_vocab, kind="embedding")
    k_mla = d.qk_nope_dim + d.qk_rope_dim
    for il in range(d.n_layers):
        b.block(il, "attn_norm.weight", d.n_embd, kind="norm")
        b.block(il, "attn_q_a_norm.weight", d.q_lora_rank, kind="norm")
        b.block(il, "attn_kv_a_norm.weight", d.kv_lora_rank, kind="norm")
        b.block(il, "attn_q_a.weight", d.n_embd, d.q_lora_rank)
        b.block(il, "attn_q_b.weight", d.q_lora_rank, d.n_head * k_mla)
        b.block(il, "attn_kv_a_mqa.weight", d.n_embd, d.kv_lora_rank + d.qk_rope_dim)
        b.block(il, "attn_k_b.weight", d.qk_nope_dim, d.kv_lora_rank, d.n_head)
        b.block(il, "attn_v_b.weight", d.kv_lora_rank, d.v_head_dim, d.n_head)
        b.block(il, "attn_output.weight", d.n_head * d.v_head_dim, d.n_embd)
        b.block(il, "ffn_norm.weight", d.n_embd, kind="norm")
        if il >= d.n_trunk or full[il]:
            ih = d.indexer_head_dim
            b.block(il, "indexer.k_norm.weight", ih, kind="norm")
            b.block(il, "indexer.k_norm.bias", ih, kind="bias")
            b.block(il, "indexer.proj.weight", d.n_embd, d.indexer_heads, kind="router")
            b.block(il, "indexer.attn_k.weight", d.n_embd, ih)
            b.block(il, "indexer.attn_q_b.weight", d.q_lora_rank, d.indexer_heads * ih)
        if il < d.n_dense_lead:
            _dense_ffn(b, d, il)
        else:
            _experts(b, d, il)
            b.block(il, "exp_probs_b.bias", d.n_expert, kind="small")
            _shared_expert(b, d, il)
        if il >= d.n_trunk:
            _nextn(b, d, il)
    _output(b, d, tied=False)
    return b


def _glm52_indexer_types(n_trunk: int) -> list[int]:
    """GLM-5.2's indexer schedule cut to ``n_trunk`` layers: layers 0-1 full, then one full layer per 4 (1 0 0 0)."""
    return [1 if il < 2 or (il - 2) % 4 == 0 else 0 for il in range(n_trunk)]


BUILDERS: dict[str, ArchBuilder] = {
    "llama": llama, "mistral3": mistral3, "qwen2": qwen2, "qwen3": qwen3, "qwen3moe": qwen3moe, "phi3": phi3,
    "gemma2": gemma2, "gemma3": gemma3, "gpt-oss": gpt_oss, "deepseek2": deepseek2, "glm4": glm4, "glm4moe": glm4moe,
    "deepseek4": deepseek4, "qwen35moe": qwen35moe,
    "glm-dsa": glm_dsa,
}
"""GGUF architecture name -> the function building its tiny model."""
