"""The architecture matrix: which tiny model is built per architecture and where it is cut.

Every proven architecture of ``artifacts.arch_support`` has a case here with a 2-way, a 3-way and an unaligned split
(cuts chosen to fall on the boundaries the architecture's per-layer rules care about); every split of every case
(variants too) is run as a backend chain and as a route through real nodes. Refused architectures have a
case when a tiny model shows the reason (``why_refused``); the special cases exercise one layer-count rule each.
"""

from __future__ import annotations

import dataclasses

from artifacts.synthetic.architectures import BUILDERS, Dims
from artifacts.synthetic.builder import ModelBuilder
from schemas.errors import BadRequestError

Bounds = tuple[int, ...]
"""Cut points of a route, ``(0, a, b, n)`` for three ranges."""


@dataclasses.dataclass(frozen=True)
class MatrixCase:
    name: str
    arch: str
    dims: Dims
    splits: dict[str, Bounds] = dataclasses.field(default_factory=dict)
    """Split name -> bounds that must route bit-exactly (empty for refused architectures)."""
    refused_splits: dict[str, Bounds] = dataclasses.field(default_factory=dict)
    """Split name -> bounds the guard must refuse (one range of each is refused)."""
    quants: tuple[str, ...] = ("F16", "Q8_0")
    unaligned: str = ""
    """What the unaligned split's cuts fall between."""
    why_refused: str = ""
    """``scale``: a chain through shards computes other logits (whatever the cause); ``abort``: a non-head shard
    kills llama.cpp; ``load``: a shard llama.cpp refuses to load."""
    about: str = ""
    """What a variant of an architecture adds, for humans."""

    def builder(self) -> ModelBuilder:
        return BUILDERS[self.arch](self.dims, f"tiny-{self.name}")

    @property
    def n_layers(self) -> int:
        return self.dims.n_layers


_EIGHT = Dims(n_layers=8, n_nextn=0)
_STANDARD = {"2-way": (0, 4, 8), "3-way": (0, 3, 6, 8)}


TINY_V4 = Dims(n_layers=10, n_nextn=1, head_dim=128, qk_rope_dim=16, indexer_head_dim=64, sliding_window=128,
               n_ctx=1024,
               compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128, 4), n_hash=3)
"""Every part of DeepSeek V4 at width 64: 4 hyper-connection streams; layers 0-1 sliding window only, then CSA
(ratio 4, lightning indexer top-16) and HCA (ratio 128) alternating and a CSA layer last, as in V4-Flash
(``[0, 0] + [4, 128] x 20 + [4]``); layers 0-2 hash-routed; 8 routed experts (2 used) plus a shared one; layer 9
the MTP block. Head width 128 and indexer width 64 differ, as in V4 (512 and 128): llama.cpp forces a key rotation
on every cache when they are equal."""

REAL_V4 = Dims(n_layers=5, n_nextn=0, n_embd=4096, n_head=64, head_dim=512, qk_rope_dim=64, q_lora_rank=1024,
               o_groups=8, o_lora_rank=1024, sliding_window=128, n_ctx=4096, n_expert=4, n_expert_used=2,
               n_ff_exp=2048, indexer_heads=64, indexer_head_dim=128, indexer_top_k=512, vocab_pad_to=129280,
               compress_ratios=(0, 0, 4, 128, 4), n_hash=3)
"""DeepSeek-V4-Flash's widths (hidden 4096, 64 heads x 512, q LoRA 1024, 8 x 1024 output groups, 4 streams,
indexer 64 x 128 top-512, 129,280 tokens, experts of 2048) with 5 layers and 4 experts: hop bytes, per-layer
attention and KV shapes are the real model's."""


def _dense(arch: str) -> MatrixCase:
    return MatrixCase(arch, arch, _EIGHT, {**_STANDARD, "unaligned": (0, 1, 7, 8)},
                      unaligned="one-layer head and tail")


MATRIX: tuple[MatrixCase, ...] = (
    _dense("llama"),
    # Mixtral's layout: llama with routed experts in every layer.
    MatrixCase("llama-moe", "llama", dataclasses.replace(_EIGHT, llama_moe=True), dict(_STANDARD), quants=("Q8_0",),
               about="Mixtral layout: 8 routed experts per layer"),
    _dense("mistral3"),
    _dense("qwen2"),
    _dense("qwen3"),
    _dense("qwen3moe"),
    _dense("phi3"),
    # Pattern 6: layers 0-4 slide, 5 is global, 6-7 slide. Cut 5 falls between a sliding and the global layer.
    MatrixCase("gemma3", "gemma3", _EIGHT, {**_STANDARD, "unaligned": (0, 2, 5, 8)},
               refused_splits={"global layer alone": (0, 5, 6, 8)},
               unaligned="sliding/sliding and sliding/global boundaries"),
    # Pattern 2: even layers slide, odd ones are global.
    MatrixCase("gpt-oss", "gpt-oss", _EIGHT, {**_STANDARD, "unaligned": (0, 1, 5, 8)},
               refused_splits={"global layer alone": (0, 3, 4, 8)},
               unaligned="sliding/global and global/sliding boundaries"),
    # Layers 0-1 dense, 2-6 MoE, 7 the MTP block.
    MatrixCase("deepseek2", "deepseek2", Dims(n_layers=8, n_dense_lead=2, n_nextn=1),
               {**_STANDARD, "unaligned": (0, 2, 6, 8)},
               refused_splits={"MTP block alone": (0, 4, 7, 8)},
               unaligned="the dense/MoE boundary, and a tail of one trunk layer plus the MTP block"),
    # With 62 layers llama.cpp takes any gemma3 for the 27B; n_embd / n_head (32) != head_dim (16) here as in the
    # real 27B (168 != 128), so the attention scale of every shard would differ.
    MatrixCase("gemma3-62", "gemma3", Dims(n_layers=62, n_head=2, n_head_kv=1, n_nextn=0),
               refused_splits={"2-way": (0, 31, 62)}, quants=("F16",), why_refused="scale"),
    # The one 62-layer gemma3 the guard lets through: n_embd / n_head (64 / 4) == head_dim (16), so the 27B formula
    # the whole model gets and the head_dim formula its shards get give the same scale.
    MatrixCase("gemma3-62-same-scale", "gemma3", Dims(n_layers=62, n_nextn=0), {"2-way": (0, 31, 62)},
               quants=("F16",), about="62 layers (taken for the 27B) with n_embd / n_head == head_dim: the cut the "
               "guard allows"),
    # A 'lite' deepseek2 (27 trunk layers, no q LoRA): its shards must be told q_lora_rank = 0.
    MatrixCase("deepseek2-lite", "deepseek2", Dims(n_layers=28, n_dense_lead=1, n_nextn=1, q_lora_rank=0),
               {"2-way": (0, 14, 28)}, quants=("F16",), about="'lite': 27 trunk layers, no q LoRA"),
    # 47 trunk layers, 154880 tokens and no expert_gating_func: llama.cpp falls back to sigmoid for the whole model
    # (GLM-4.7-Flash) and to softmax for any shard, unless the shard pins it.
    MatrixCase("deepseek2-gating", "deepseek2",
               Dims(n_layers=48, n_dense_lead=1, n_nextn=1, vocab_pad_to=154880, expert_gating_func=None),
               {"2-way": (0, 24, 48)}, quants=("F16",),
               about="47 trunk layers, 154880 tokens, no expert_gating_func key"),
    # Layers 0-2 hash-routed (0-1 sliding only, 2 CSA), 3..8 HCA/CSA alternating, 9 the MTP block. Cut 3 is right
    # after the hash layers (between CSA 2 and HCA 3), 7 between CSA 6 and HCA 7, 5 and 6 HCA/CSA and CSA/HCA.
    MatrixCase("deepseek4", "deepseek4", TINY_V4,
               {"2-way": (0, 5, 10), "3-way": (0, 3, 6, 10), "unaligned": (0, 3, 7, 10)},
               refused_splits={"hash layer off the head": (0, 2, 10), "HCA layer alone": (0, 3, 4, 10)},
               unaligned="right after the hash layers (CSA/HCA), and CSA/HCA before a tail of HCA, CSA and MTP"),
    # Layers 0-2 Gated DeltaNet (recurrent), 3 full attention, 4-6 DeltaNet, 7 attention (interval 4, as the
    # 35B-A3B). The whole file runs; a shard fed hidden states gets wrong M-RoPE positions (see arch_support).
    MatrixCase("qwen35moe", "qwen35moe", _EIGHT, refused_splits={"2-way": (0, 4, 8)}, quants=("F16",),
               why_refused="scale"),
    # Layers 0 dense, 1-6 MoE, 7 the MTP block; indexer types 1 1 1 0 0 0 1 (GLM-5.2's IndexShare schedule).
    # Indexer heads of 64: llama.cpp's Hadamard rotation of indexer keys starts at 64 wide.
    MatrixCase("glm-dsa", "glm-dsa", Dims(n_layers=8, n_nextn=1, indexer_head_dim=64),
               refused_splits={"2-way": (0, 4, 8)}, quants=("F16",), why_refused="load"),
    MatrixCase("gemma2", "gemma2", _EIGHT, refused_splits={"2-way": (0, 4, 8)}, quants=("F16",),
               why_refused="scale"),
    MatrixCase("glm4", "glm4", Dims(n_layers=8, n_nextn=1), refused_splits={"2-way": (0, 4, 8)}, quants=("F16",),
               why_refused="abort"),
    MatrixCase("glm4moe", "glm4moe", Dims(n_layers=8, n_dense_lead=1, n_nextn=1),
               refused_splits={"2-way": (0, 4, 8)}, quants=("F16",), why_refused="abort"),
)


REAL_WIDTH: dict[str, Dims] = {"deepseek4": REAL_V4}
"""Architectures with a real-width synthetic model (``swarmroute artifact synthetic --width real``)."""


def synthetic_model(arch: str, *, width: str = "tiny", quant: str | None = None) -> tuple[ModelBuilder, str]:
    """The builder and weight type of ``arch``'s synthetic model: the matrix's case of that name (its first
    quantization), or the real-width model. Raises ``BadRequestError`` naming what exists."""
    if arch not in BUILDERS:
        raise BadRequestError(f"no synthetic model for architecture {arch!r}; known: {', '.join(sorted(BUILDERS))}")
    if width == "real":
        if arch not in REAL_WIDTH:
            raise BadRequestError(f"no real-width synthetic model for {arch!r}; real width exists for "
                                  f"{', '.join(sorted(REAL_WIDTH))}")
        return BUILDERS[arch](REAL_WIDTH[arch], f"real-width-{arch}"), quant or "Q8_0"
    if width != "tiny":
        raise BadRequestError(f"width must be tiny or real, not {width!r}")
    matrix_case = next((c for c in MATRIX if c.name == arch), None)
    if matrix_case is None:
        return BUILDERS[arch](Dims(), f"tiny-{arch}"), quant or "F16"
    return matrix_case.builder(), quant or matrix_case.quants[0]


def case(name: str) -> MatrixCase:
    for c in MATRIX:
        if c.name == name:
            return c
    raise KeyError(name)


def ranges(bounds: Bounds) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:], strict=True))
