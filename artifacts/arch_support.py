"""Which architectures may be cut into layer-range shards, and the per-architecture rules that keep a cut exact.

A shard declares fewer layers than its model. llama.cpp derives some settings from the declared layer count (the
"model type" switch in each ``load_arch_hparams``, the trunk/MTP split, sliding-window bookkeeping), so a shard can
load fine and compute something else. This module is the guard: every architecture the matrix in
``tests/test_arch_matrix.py`` proves bit-exact is listed as ``proven`` with its layer-count rules; architectures
known to be wrong or impossible to cut are ``refused`` with the reason; anything else is *unproven* and refused unless
the caller passes ``allow_unproven`` (the user accepting the risk).

The rules were read from llama.cpp 0c1e57098 (the commit llama-cpp-python 0.3.36 vendors): every
``switch (hparams.n_layer())`` in ``src/models/*.cpp`` and every use of the resulting ``type`` or of ``n_layer()``
outside the layer loop. For the proven architectures, ``type`` only names the model except where a rule below says
otherwise. A rule either *pins* the whole model's value with a metadata key llama.cpp reads (the shard then derives
exactly what the whole model derives) or refuses the range with the architecture, the setting and the layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from gguf import GGUFValueType

from artifacts.gguf_layout import KV
from artifacts.layer_metadata import swa_pattern
from schemas.errors import BadRequestError


@dataclasses.dataclass(frozen=True, slots=True)
class View:
    """What llama.cpp sees of a file (the whole model or one shard) when it derives a setting."""

    arch: str
    n_trunk: int
    """``n_layer()``: declared blocks minus next-token-prediction blocks."""
    n_vocab: int
    metadata: Mapping[str, Any]

    def value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)


class Unfixable(Exception):
    """A rule cannot make the shard derive the whole model's value; the message says why."""


Reconcile = Callable[[View, View], list[KV]]
"""(whole model, shard as written so far) -> metadata pins for the shard; raises ``Unfixable``."""


@dataclasses.dataclass(frozen=True, slots=True)
class LayerCountRule:
    setting: str
    """The llama.cpp hparam (or behaviour) derived from the layer count."""
    source: str
    """Where llama.cpp derives it."""
    reconcile: Reconcile
    remedy: str
    """What the shard writer does about it, for humans (the docs table)."""


Status = Literal["proven", "refused"]


@dataclasses.dataclass(frozen=True, slots=True)
class ArchSupport:
    arch: str
    status: Status
    families: str
    """Model families that ship GGUFs of this architecture."""
    reason: str = ""
    """Why a refused architecture cannot be cut."""
    rules: tuple[LayerCountRule, ...] = ()
    cut_rules: str = ""
    """Which boundaries may be cut, for humans (the docs table)."""
    limits: str = ""
    output_required: bool = False
    """llama.cpp requires ``output.weight`` (no fallback to the tied embedding): non-tail shards get a zero one."""
    always_swa: bool = False
    """Sliding-window attention is on whatever the metadata says (otherwise: when ``attention.sliding_window`` > 0)."""
    range_check: Callable[[CutRequest], list[KV]] | None = None
    """Refuses ranges the architecture cannot run (raises ``Unfixable``), or returns pins for the shard."""


# --- layer-count rules ---------------------------------------------------------------------------------------------


def _attention_scale_27b(type_layers: int) -> Reconcile:
    """gemma2/gemma3 pick ``f_attention_scale`` from the model type: 1/sqrt(n_embd / n_head(0)) for the 27B
    (``type_layers`` trunk layers), 1/sqrt(head_dim) otherwise. No key overrides it."""

    def scale(v: View) -> float:
        n_embd, n_head = v.value("embedding_length"), v.value("attention.head_count")
        if n_embd is None or n_head is None:
            raise Unfixable("embedding_length or attention.head_count is missing")
        head0 = int(n_head[0] if isinstance(n_head, list) else n_head)
        head_dim = int(v.value("attention.key_length", int(n_embd) // head0))
        return 1.0 / math.sqrt(int(n_embd) // head0 if v.n_trunk == type_layers else head_dim)

    def reconcile(whole: View, shard: View) -> list[KV]:
        if type_layers not in (whole.n_trunk, shard.n_trunk):
            return []  # neither is taken for the 27B: both use 1/sqrt(head_dim)
        if scale(whole) != scale(shard):
            raise Unfixable(f"llama.cpp takes a {type_layers}-layer {whole.arch} for the 27B and sets "
                            f"f_attention_scale = {scale(whole):.6g} for the {whole.n_trunk}-layer model but "
                            f"{scale(shard):.6g} for a {shard.n_trunk}-layer shard; no metadata key overrides it")
        return []

    return reconcile


def _deepseek2_lite(whole: View, shard: View) -> list[KV]:
    """deepseek2 treats 26/27-layer models (and 48 layers with a 128256-token vocabulary) as "lite": it then ignores
    ``attention.q_lora_rank`` (n_lora_q = 0, a plain attn_q) and otherwise requires it (a missing key fails the
    load)."""

    def lite(v: View) -> bool:
        return v.n_trunk in (26, 27) or (v.n_trunk == 48 and v.n_vocab == 128256)

    def q_lora(v: View) -> int | None:
        if lite(v):
            return 0
        rank = v.value("attention.q_lora_rank")
        return None if rank is None else int(rank)

    want = q_lora(whole)
    if want is None or q_lora(shard) == want:
        return []  # a non-lite model without the key does not load whole either
    if lite(shard):
        raise Unfixable(f"a {shard.n_trunk}-layer deepseek2 shard counts as a 'lite' model in llama.cpp and ignores "
                        f"attention.q_lora_rank (the whole model uses {want}); choose another range")
    return [KV(f"{whole.arch}.attention.q_lora_rank", GGUFValueType.UINT32, want)]


def _deepseek2_gating(whole: View, shard: View) -> list[KV]:
    """Without ``expert_gating_func`` deepseek2 falls back to sigmoid for 47/48-layer files with a 154880-token
    vocabulary (GLM-4.7-Flash) and softmax otherwise: pin the whole model's choice."""

    def gating(v: View) -> int:
        explicit = int(v.value("expert_gating_func", 0) or 0)
        if explicit:
            return explicit
        return 2 if v.n_trunk in (47, 48) and v.n_vocab == 154880 else 1

    want = gating(whole)
    if gating(shard) == want:
        return []
    return [KV(f"{whole.arch}.expert_gating_func", GGUFValueType.UINT32, want)]


def _deepseek4_hash_layers(req: CutRequest) -> list[KV]:
    """deepseek4's first ``hash_layer_count`` layers route experts by token id (``ffn_gate_tid2eid``, looked up
    from the ubatch's tokens), which only the head has: a shard fed the residual streams would route those layers
    by the router instead (models/deepseek4.cpp takes the non-hash path whenever the input is not token ids). The
    rule: every hash layer stays on the head. The head's shard declares them all, every other shard none."""
    n_hash = int(req.value("hash_layer_count", 0) or 0)
    if not n_hash:
        return []
    if req.start == 0 and req.end < min(n_hash, req.n_trunk):
        raise Unfixable(f"layers 0..{n_hash - 1} route experts by token id (hash routing) and must all stay on "
                        f"the head, which alone receives token ids; layers {req.end}..{n_hash - 1} would go to a "
                        f"shard fed hidden states. Cut at layer {n_hash} or later")
    if 0 < req.start < n_hash:
        raise Unfixable(f"layers 0..{n_hash - 1} route experts by token id (hash routing) and must all stay on "
                        f"the head, which alone receives token ids; this shard would take layers "
                        f"{req.start}..{min(req.end, n_hash) - 1} of them. Cut at layer {n_hash} or later")
    _deepseek4_needs_csa(req)
    return [KV(f"{req.arch}.hash_layer_count", GGUFValueType.UINT32, n_hash if req.start == 0 else 0)]


def _deepseek4_needs_csa(req: CutRequest) -> None:
    """llama.cpp always rotates the lightning indexer's keys (a Hadamard matrix sized from the cache's head width);
    a shard without a ratio-4 layer gets an indexer cache of no layers, head width 0, and
    ``llama_kv_cache::build_input_k_rot`` divides by zero (SIGFPE) building the first graph (seen on the tiny
    model: a lone HCA layer)."""
    ratios = req.value("attention.compress_ratios")
    if not isinstance(ratios, list) or 4 not in ratios[:req.n_trunk]:
        return
    if 4 not in ratios[req.start:min(req.end, req.n_trunk)]:
        raise Unfixable(f"layers {req.start}..{min(req.end, req.n_trunk) - 1} hold no CSA (compress ratio 4) layer; "
                        "llama.cpp's lightning-indexer cache then has no layers and divides by zero on load "
                        "(llama_kv_cache::build_input_k_rot); widen the range")


_GEMMA3_27B = LayerCountRule(
    "f_attention_scale", "models/gemma3.cpp load_arch_hparams: type = LLM_TYPE_27B when n_layer == 62",
    _attention_scale_27b(62),
    "refuse any cut whose shard would derive another scale (every cut of a 62-layer model whose "
    "n_embd/n_head differs from head_dim, e.g. Gemma 3 27B)")
_GEMMA2_27B = LayerCountRule(
    "f_attention_scale", "models/gemma2.cpp load_arch_hparams: type = LLM_TYPE_27B when n_layer == 46",
    _attention_scale_27b(46), "refuse (as gemma3)")
_DEEPSEEK2_LITE = LayerCountRule(
    "n_lora_q (is_lite)", "models/deepseek2.cpp load_arch_hparams: is_lite when n_layer is 26 or 27, or 48 with "
    "a 128256-token vocabulary", _deepseek2_lite,
    "pin attention.q_lora_rank = 0 on shards of a lite model; refuse shards that would become lite")
_DEEPSEEK2_GATING = LayerCountRule(
    "expert_gating_func", "models/deepseek2.cpp load_arch_hparams: sigmoid fallback when n_layer is 47 or 48 "
    "and the vocabulary has 154880 tokens", _deepseek2_gating,
    "pin expert_gating_func to the whole model's value")


# --- the table -----------------------------------------------------------------------------------------------------

_GRAPH_ONLY_TYPE = "model type keyed on n_layer only names the model"

SUPPORT: dict[str, ArchSupport] = {a.arch: a for a in (
    ArchSupport("llama", "proven", "Llama 2/3.x, Mistral 7B / Nemo (MistralForCausalLM), Mixtral",
                cut_rules="any boundary", limits=_GRAPH_ONLY_TYPE),
    ArchSupport("mistral3", "proven", "Mistral Small 3.x, Ministral 3",
                cut_rules="any boundary", limits="attention temperature scaling depends on the position only"),
    ArchSupport("qwen2", "proven", "Qwen 2, Qwen 2.5, QwQ, DeepSeek-R1 Qwen distills", cut_rules="any boundary"),
    ArchSupport("qwen3", "proven", "Qwen 3 dense", cut_rules="any boundary"),
    ArchSupport("qwen3moe", "proven", "Qwen 3 MoE (30B-A3B, 235B-A22B)", cut_rules="any boundary"),
    ArchSupport("phi3", "proven", "Phi-3, Phi-3.5-mini, Phi-4(-mini)", cut_rules="any boundary",
                limits="llama.cpp itself disables Phi's sliding window"),
    ArchSupport("gemma3", "proven", "Gemma 3 (text), MedGemma, Rnj-1", rules=(_GEMMA3_27B,),
                cut_rules="any boundary; the per-layer sliding pattern is written into each shard; a shard must "
                "hold at least one sliding layer",
                limits="Gemma 3 27B (62 layers) is refused: its attention scale is keyed on the layer count"),
    ArchSupport("gpt-oss", "proven", "gpt-oss 20B/120B", output_required=True, always_swa=True,
                cut_rules="any boundary; a shard must hold at least one sliding layer (so never one odd layer "
                "alone)"),
    ArchSupport("deepseek2", "proven",
                "DeepSeek V2/V3/R1, Kimi K2 (DeepseekV3 layout), GLM-4.7-Flash, Mistral's MoE format",
                rules=(_DEEPSEEK2_LITE, _DEEPSEEK2_GATING),
                cut_rules="any boundary between trunk layers (dense/MoE too); MTP layers stay with the last trunk "
                "layer (a range of MTP layers only is refused)"),
    ArchSupport("gemma2", "refused", "Gemma 2", rules=(_GEMMA2_27B,), always_swa=True,
                reason="models/gemma2.cpp scales every input by sqrt(n_embd) (ggml_scale on build_inp_embd, "
                "tokens or not): a shard fed the residual stream would rescale it"),
    ArchSupport("gemma", "refused", "Gemma 1",
                reason="models/gemma.cpp scales every input by sqrt(n_embd), tokens or not: a shard fed the "
                "residual stream would rescale it"),
    ArchSupport("glm4", "refused", "GLM-4 0414, GLM-Z1",
                reason="models/glm4.cpp aborts (GGML_ABORT) when fed embeddings without M-RoPE sections: a shard "
                "after the head cannot take hidden states"),
    ArchSupport("glm4moe", "refused", "GLM-4.5, GLM-4.6, GLM-4.7",
                reason="models/glm4-moe.cpp aborts (GGML_ABORT) when fed embeddings without M-RoPE sections: a "
                "shard after the head cannot take hidden states"),
    ArchSupport("qwen35moe", "refused", "Qwen 3.5 / 3.6 MoE (35B-A3B, 122B-A10B, 397B-A17B), Ornith-class hybrids",
                reason="models/qwen35moe.cpp rotates its full-attention layers with interleaved M-RoPE, 4 positions "
                "per row; llama.cpp widens 1-D positions to 4 for token batches only (llm_graph_input_pos), and "
                "reads an embedding batch's positions section-major (pos[j * n_tokens + i], llama_batch_allocr): "
                "a shard fed hidden states with one position per row rotates by other positions. The tiny model "
                "shows it: a 2-way chain computes other logits (max abs diff 0.089, greedy tokens still equal); "
                "given [p, p, p, 0] section-major positions the same chain is bit-exact (0.0), so the fix is in "
                "the backend's batch. Its Gated DeltaNet state cannot be truncated either (docs/models/ornith.md)"),
    ArchSupport("glm-dsa", "refused", "GLM-5, GLM-5.1, GLM-5.2",
                reason="a shard does not load: attention.indexer.types holds one entry per trunk layer (the MTP "
                "block excluded), so the shard writer, which slices arrays of block_count entries, copies it "
                "whole and llama.cpp rejects it (tiny model: 'wrong array length; expected 4, got 7'). Sliced to "
                "the shard's trunk layers, a cut before a full-indexer layer is bit-exact on the tiny model (max "
                "abs diff 0.0); a shard starting on an IndexShare layer (type 0) has no previous top-k to reuse and "
                "aborts llama.cpp (GGML_ASSERT prev_top_k in models/glm-dsa.cpp, seen on the tiny model)"),
    ArchSupport("deepseek4", "proven", "DeepSeek V4 Flash / Pro", output_required=True,
                range_check=_deepseek4_hash_layers,
                cut_rules="any boundary at or after the last hash-routed layer (they stay on the head, which has "
                "the token ids); MTP layers stay with the last trunk layer",
                limits="hops carry all hc_mult x n_embd hyper-connection values per position (l_last of the "
                "last layer, written into hc_init of the next shard by the eval callback); CSA/HCA compressor "
                "state stays on each layer's node"),
)}
"""Architecture -> support. Proven entries are exactly the architectures of the matrix test."""

KNOWN_HAZARDS: dict[str, str] = {
    "llama4": "use_kq_norm depends on LLM_TYPE_17B_128E (models/llama4.cpp), n_no_rope_layer_step = n_layer",
    "baichuan": "ALiBi and position handling depend on LLM_TYPE_13B/7B (models/baichuan.cpp)",
    "minicpm": "f_residual_scale = 1.4/sqrt(n_layer) by default (models/minicpm.cpp)",
    "exaone4": "sliding-window attention only when n_layer == 64 (models/exaone4.cpp)",
    "smallthinker": "n_no_rope_layer_step = n_layer (models/smallthinker.cpp)",
    "eurobert": "settings keyed on n_layer == 12 (models/eurobert.cpp)",
}
"""Unproven architectures whose llama.cpp loader derives settings from the layer count: named in the refusal."""


def proven_architectures() -> list[str]:
    return sorted(a for a, s in SUPPORT.items() if s.status == "proven")


def output_required(arch: str) -> bool:
    support = SUPPORT.get(arch)
    return support is not None and support.output_required


# --- the check -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class CutRequest:
    """One shard of one model, described by the model's metadata (every key but ``tokenizer.*`` is enough)."""

    arch: str
    n_layers: int
    n_vocab: int
    metadata: Mapping[str, Any]
    start: int
    end: int
    where: str = ""
    """The file or model the request is about, for error messages."""

    def value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    @property
    def n_nextn(self) -> int:
        return int(self.value("nextn_predict_layers", 0) or 0)

    @property
    def n_trunk(self) -> int:
        return self.n_layers - self.n_nextn

    @property
    def keeps_vocab(self) -> bool:
        return self.start == 0 or self.end == self.n_layers

    def whole(self) -> View:
        return View(self.arch, self.n_trunk, self.n_vocab, self.metadata)

    def shard(self) -> View:
        trunk = max(0, min(self.end, self.n_trunk) - self.start)
        return View(self.arch, trunk, self.n_vocab if self.keeps_vocab else 1, self.metadata)


def _refuse(req: CutRequest, what: str) -> BadRequestError:
    where = f"{req.where}: " if req.where else ""
    return BadRequestError(f"{where}cannot cut layers [{req.start}, {req.end}) of this {req.n_layers}-layer "
                           f"{req.arch!r} model: {what}")


def _uses_swa(req: CutRequest, support: ArchSupport | None) -> bool:
    if support is not None and support.always_swa:
        return True
    return int(req.value("attention.sliding_window", 0) or 0) > 0


def _check_swa(req: CutRequest, support: ArchSupport | None) -> None:
    """llama.cpp builds a sliding-window cache for a sliding-window model and asserts that some layer slides
    (``GGML_ASSERT(hparams.is_swa_any())`` in llama-model.cpp): an abort, not an error, for a shard without one."""
    explicit = req.value("attention.sliding_window_pattern")
    if isinstance(explicit, list):
        pattern: list[bool] | None = [bool(x) for x in explicit]
    else:
        scalar = int(explicit) if explicit is not None else None
        pattern = swa_pattern(req.arch, req.n_trunk, scalar)
    if pattern is None or not _uses_swa(req, support) or not any(pattern):
        return
    if not any(pattern[req.start:min(req.end, req.n_trunk)]):
        raise _refuse(req, "none of these layers uses the sliding window, and llama.cpp aborts when a "
                           "sliding-window model has no sliding layer; widen the range")


def check_cut(req: CutRequest, *, allow_unproven: bool = False) -> tuple[KV, ...]:
    """Refuse ``req`` with a ``BadRequestError`` naming the file, architecture, setting and layers, or return the
    metadata pins that make the shard derive what the whole model derives. The whole range is never a cut."""
    if req.start == 0 and req.end == req.n_layers:
        return ()
    support = SUPPORT.get(req.arch)
    if support is None and not allow_unproven:
        hazard = KNOWN_HAZARDS.get(req.arch)
        extra = f" (known hazard: {hazard})" if hazard else ""
        raise _refuse(req, f"architecture {req.arch!r} is not proven to route bit-exactly across shards{extra}; "
                           f"proven: {', '.join(proven_architectures())}. Serve it whole on one node, or accept "
                           "the risk with the unproven-architecture override")
    if support is not None and support.status == "refused":
        raise _refuse(req, support.reason)
    if req.n_nextn and req.start >= req.n_trunk:
        raise _refuse(req, f"layers {req.n_trunk}..{req.n_layers - 1} are next-token-prediction (MTP) blocks that "
                           "llama.cpp never runs in the main pass; a shard needs at least one trunk layer, so the "
                           f"last cut must be at or before layer {req.n_trunk - 1}")
    _check_swa(req, support)
    pins: list[KV] = []
    if support is not None and support.range_check is not None:
        try:
            pins += support.range_check(req)
        except Unfixable as exc:
            raise _refuse(req, str(exc)) from None
    whole, shard = req.whole(), req.shard()
    for rule in support.rules if support is not None else ():
        try:
            pins += rule.reconcile(whole, shard)
        except Unfixable as exc:
            raise _refuse(req, f"{rule.setting}: {exc}") from None
    return tuple(pins)


def metadata_map(fields: Sequence[KV]) -> dict[str, Any]:
    return {kv.key: kv.value for kv in fields}
