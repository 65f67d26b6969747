"""Rewriting GGUF metadata for a layer range: every key whose meaning depends on a layer's index.

llama.cpp decides per-layer behaviour from the *local* layer index of the file it loads. A shard holding layers
[a, b) renumbered 0..b-a-1 keeps the original behaviour only if every such key is rewritten:

* ``{arch}.block_count`` becomes b - a;
* per-layer arrays (length == n_layers, e.g. head counts per layer) are sliced to [a, b);
* sliding-window patterns become an explicit per-layer bool array sliced from the original, because llama.cpp's
  fallback rule (``il % n_pattern``) would otherwise be applied to the new index (the table below is read from
  llama.cpp 0c1e57098, ``load_swa_pattern`` calls in src/models/*.cpp);
* leading dense blocks and trailing next-token-prediction layers are counted inside the range;
* periodic rules we cannot express per layer (``moe_every_n_layers``...) require the range to start on a period;
* ``{arch}.embedding_scale`` is 1.0 off the head, where llama.cpp receives already-scaled embeddings;
* keys the cut guard pins (``RangeSpec.pins``, from ``artifacts.arch_support``) replace the model's value, so a
  setting llama.cpp would derive from the shard's layer count comes out as the whole model's.
"""

from __future__ import annotations

import dataclasses

from gguf import GGUFValueType

from artifacts.gguf_layout import KV
from schemas.errors import BadRequestError

SWA_DEFAULTS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False), "gemma3": (6, False), "gemma3n": (5, False), "gemma-embedding": (6, False),
    "cohere2": (4, False), "cohere2moe": (4, True), "olmo2": (4, False), "plamo3": (8, False), "llama4": (4, False),
    "exaone4": (4, False), "exaone-moe": (4, False), "afmoe": (4, False), "gpt-oss": (2, False),
    "smallthinker": (4, True), "modern-bert": (3, True), "laguna": (4, True), "mellum": (4, False),
    "muse-glimmer": (4, False),
}
"""arch -> (default n_pattern, dense_first) of llama.cpp's ``set_swa_pattern``."""

_PERIODIC_KEYS = ("moe_every_n_layers", "interleave_moe_layer_step", "full_attention_interval",
                  "rescale_every_n_layers", "attention.rope_pattern")
"""Scalar rules keyed on ``il % k``: still right after renumbering only when the range starts at a multiple of k."""

_NOT_PER_LAYER = ("rope.dimension_sections", "ple.head_vocab_sizes")
"""Fixed-length arrays that are not indexed by layer, even when a model happens to have that many layers."""

SWARMROUTE_KEYS = ("swarmroute.layer_start", "swarmroute.layer_end", "swarmroute.n_layers_total",
                   "swarmroute.manifest_id")


@dataclasses.dataclass(frozen=True, slots=True)
class RangeSpec:
    """A layer range of a model: what the metadata rewrite needs to know."""

    architecture: str
    n_layers: int
    start: int
    end: int
    keep_tokenizer: bool
    manifest_id: str = ""
    pins: tuple[KV, ...] = ()
    """Keys set explicitly so the shard derives what the whole model derives (``artifacts.arch_support``)."""

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.end == self.n_layers


def swa_pattern(arch: str, n_layers: int, scalar: int | None) -> list[bool] | None:
    """llama.cpp's per-layer is_swa for ``arch`` (None when the arch has no sliding-window rule)."""
    if arch not in SWA_DEFAULTS:
        return None
    n_pattern, dense_first = SWA_DEFAULTS[arch]
    if scalar is not None:
        n_pattern = scalar
    if n_pattern == 0:
        return [True] * n_layers
    if dense_first:
        return [il % n_pattern != 0 for il in range(n_layers)]
    return [il % n_pattern < n_pattern - 1 for il in range(n_layers)]


def _is_per_layer(kv: KV, spec: RangeSpec) -> bool:
    return (kv.key.startswith(f"{spec.architecture}.") and kv.type == GGUFValueType.ARRAY
            and isinstance(kv.value, list) and len(kv.value) == spec.n_layers
            and kv.key.removeprefix(f"{spec.architecture}.") not in _NOT_PER_LAYER)


def _rewrite(kv: KV, spec: RangeSpec) -> KV:
    a, b, n, arch = spec.start, spec.end, spec.n_layers, spec.architecture
    key = kv.key
    if key == f"{arch}.block_count":
        return dataclasses.replace(kv, value=b - a)
    if key == f"{arch}.leading_dense_block_count":
        return dataclasses.replace(kv, value=max(0, min(int(kv.value), b) - a))
    if key == f"{arch}.nextn_predict_layers":
        return dataclasses.replace(kv, value=max(0, b - max(a, n - int(kv.value))))
    if key == f"{arch}.embedding_scale" and not spec.is_head:
        return dataclasses.replace(kv, value=1.0)
    if _is_per_layer(kv, spec):
        return dataclasses.replace(kv, value=kv.value[a:b])
    for suffix in _PERIODIC_KEYS:
        if key == f"{arch}.{suffix}" and kv.type != GGUFValueType.ARRAY and int(kv.value) > 0 and a % int(kv.value):
            raise BadRequestError(f"{key}={kv.value} is periodic in the layer index: a shard must start at a "
                                  f"multiple of it, not at layer {a}")
    return kv


def _swa_field(fields: list[KV], spec: RangeSpec) -> KV | None:
    key = f"{spec.architecture}.attention.sliding_window_pattern"
    current = next((kv for kv in fields if kv.key == key), None)
    if current is not None and current.type == GGUFValueType.ARRAY:
        return None  # already explicit: the per-layer slicing handles it
    scalar = int(current.value) if current is not None else None
    pattern = swa_pattern(spec.architecture, spec.n_layers, scalar)
    if pattern is None:
        if current is not None and spec.start:
            raise BadRequestError(f"{key}={current.value} on unknown arch {spec.architecture!r}: cannot make it "
                                  "per-layer, so only shards starting at layer 0 are possible")
        return None
    return KV(key, GGUFValueType.ARRAY, pattern[spec.start : spec.end], GGUFValueType.BOOL)


def _provenance(spec: RangeSpec) -> list[KV]:
    u32 = GGUFValueType.UINT32
    return [KV("swarmroute.layer_start", u32, spec.start), KV("swarmroute.layer_end", u32, spec.end),
            KV("swarmroute.n_layers_total", u32, spec.n_layers),
            KV("swarmroute.manifest_id", GGUFValueType.STRING, spec.manifest_id)]


def _no_vocab(spec: RangeSpec) -> list[KV]:
    # tokenizer.ggml.model "none" + vocab_size 1 -> llama.cpp n_vocab = 1: a 1-row token_embd and a 1-row lm_head.
    return [KV("tokenizer.ggml.model", GGUFValueType.STRING, "none"),
            KV(f"{spec.architecture}.vocab_size", GGUFValueType.UINT32, 1)]


def shard_fields(fields: list[KV], spec: RangeSpec) -> list[KV]:
    """The metadata of the shard for ``spec``, from the full model's ``fields`` (order kept, new keys appended)."""
    dropped = ("general.architecture", "general.alignment", *SWARMROUTE_KEYS)
    swa = _swa_field(fields, spec)
    pinned = {kv.key for kv in spec.pins}
    out: list[KV] = []
    for kv in fields:
        if kv.key in dropped or kv.key in pinned or kv.key.startswith("split."):
            continue
        if kv.key.startswith("tokenizer.") and not spec.keep_tokenizer:
            continue
        if kv.key == f"{spec.architecture}.vocab_size" and not spec.keep_tokenizer:
            continue
        if swa is not None and kv.key == swa.key:
            continue  # the scalar rule is replaced by the explicit array below
        out.append(kv if spec.is_whole else _rewrite(kv, spec))
    if swa is not None:
        out.append(swa)
    if not spec.keep_tokenizer:
        out += _no_vocab(spec)
    return out + list(spec.pins) + _provenance(spec)
