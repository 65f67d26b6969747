"""A ``ModelShape`` from a GGUF header or a Model Artifact manifest: weight bytes from the tensor table, cache sizes
from the metadata, mirroring how llama.cpp (the vendored commit 0c1e57098) sizes its caches.

Cache rules followed (llama.cpp source, src/):
- plain attention: K and V rows of ``n_kv_heads * key_length`` / ``value_length`` per token (llama-kv-cache.cpp);
- MLA (``attention.kv_lora_rank`` present): a K-only cache of ``key_length`` (= kv_lora_rank + rope dims);
- DSA indexers (``attention.indexer.key_length``): one more K-only row per token on "full" indexer layers;
- sliding-window layers keep ``attention.sliding_window`` positions; which layers slide comes from
  ``attention.sliding_window_pattern`` (per-layer array or period) or the architecture's default period;
- recurrent layers (SSM / gated delta-net) keep a fixed f32 state (llama-hparams.cpp ``n_embd_r``/``n_embd_s``);
- deepseek4: a 128-row raw window plus compressed rows per ``compress_ratios`` (llama-kv-cache-dsv4.cpp).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from artifacts.gguf_layout import layer_of, read_layout, role_of
from artifacts.model_shape import KVTerm, LayerGroup, LayerShape, ModelShape
from schemas.manifest import ModelManifest

SWA_DEFAULT_PERIOD = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "gpt-oss": 2, "exaone4": 4}
"""Architectures whose loader calls ``load_swa_pattern(ml, N)``: every N-th layer is global when the GGUF has no
explicit ``sliding_window_pattern``."""

SWA_IGNORED = frozenset({"phi3"})
"""Architectures whose loader drops ``attention.sliding_window`` (models/phi3.cpp: "Phi SWA is currently disabled"):
every layer keeps its whole context."""

RECURRENT_DEFAULT_INTERVAL = {"qwen3next": 4, "qwen35": 4, "qwen35moe": 4}
"""Hybrid linear-attention models: every N-th layer is full attention, the rest are gated delta-net layers."""

DSV4_RAW_ROWS_KEY = "attention.sliding_window"


@dataclasses.dataclass(frozen=True, slots=True)
class _Header:
    """The subset of a GGUF header this module reads, whatever it was loaded from."""

    name: str
    arch: str
    values: dict[str, Any]
    tensors: tuple[tuple[str, int], ...]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{key}", default)


def shape_from_gguf(path: Path) -> ModelShape:
    """Read only the header of ``path`` (tensor data is never touched)."""
    layout = read_layout(path)
    values = {kv.key: kv.value for kv in layout.fields}
    header = _Header(name=str(values.get("general.name", path.stem)), arch=layout.architecture, values=values,
                     tensors=tuple((t.name, t.size) for t in layout.tensors))
    return _shape(header, source=str(path))


def shape_from_manifest(manifest: ModelManifest, source: str = "") -> ModelShape:
    values = {kv.key: kv.value for kv in manifest.metadata}
    header = _Header(name=manifest.name or manifest.model_id[:12], arch=manifest.architecture, values=values,
                     tensors=tuple((t.name, t.size) for t in manifest.tensors))
    return _shape(header, source=source or f"manifest {manifest.manifest_id[:12]}")


def _per_layer(value: Any, il: int, default: Any) -> Any:
    if value is None:
        return default
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return value[il] if il < len(value) else default
    return value


def _n_main_layers(h: _Header, block_bytes: dict[int, int]) -> int:
    """Trunk layers: ``block_count`` minus NextN/MTP blocks, when those blocks are really in the file."""
    n_all = int(h.get("block_count", 0))
    nextn = int(h.get("nextn_predict_layers", 0) or 0)
    if nextn and (n_all - nextn) not in block_bytes:
        return n_all  # the converter dropped the MTP block but kept the key: llama.cpp treats nextn as 0 too
    return n_all - nextn


def _shape(h: _Header, source: str) -> ModelShape:
    block_bytes: dict[int, int] = {}
    role_bytes = {"embedding": 0, "output": 0, "shared": 0}
    names = set()
    for name, size in h.tensors:
        names.add(name)
        il = layer_of(name)
        if il is None:
            role_bytes[role_of(name)] += size
        else:
            block_bytes[il] = block_bytes.get(il, 0) + size
    n_main = _n_main_layers(h, block_bytes)
    n_all = max(n_main, int(h.get("block_count", 0)))
    layers = tuple(_layer(h, il, block_bytes.get(il, 0)) for il in range(n_main))
    mtp = tuple(dataclasses.replace(_layer(h, il, block_bytes.get(il, 0)), kind="mtp")
                for il in range(n_main, n_all) if il in block_bytes)
    # Tied models use token_embd as lm_head, and MTP blocks without their own embedding re-embed the drafted token.
    own_mtp_embd = any(f"blk.{m.index}.nextn.embed_tokens.weight" in names for m in mtp)
    tail_embedding = "output.weight" not in names or (bool(mtp) and not own_mtp_embd)
    hidden = int(h.get("embedding_length", 0))
    streams = int(h.get("hyper_connection.count", 0) or 0)
    return ModelShape(
        name=h.name, arch=h.arch, hidden_size=hidden, hop_shape=(streams, hidden) if streams > 1 else (hidden,),
        context_length=int(h.get("context_length", 0) or 0), layers=layers, head_bytes=role_bytes["embedding"],
        tail_bytes=role_bytes["output"], shared_bytes=role_bytes["shared"], tail_needs_embedding=tail_embedding,
        mtp_layers=mtp, groups=_groups(h, n_main),
        source=source)


def _layer(h: _Header, il: int, weight_bytes: int) -> LayerShape:
    if h.arch == "deepseek4":
        return _dsv4_layer(h, il, weight_bytes)
    if _is_recurrent(h, il):
        return LayerShape(il, "recurrent", weight_bytes, state_elements=_recurrent_state(h))
    n_kv = int(_per_layer(h.get("attention.head_count_kv"), il, _per_layer(h.get("attention.head_count"), il, 0)))
    if n_kv == 0:
        return LayerShape(il, "none", weight_bytes)
    n_head = int(_per_layer(h.get("attention.head_count"), il, 1)) or 1
    key_len = int(h.get("attention.key_length", 0) or int(h.get("embedding_length", 0)) // n_head)
    value_len = int(h.get("attention.value_length", 0) or key_len)
    if h.get("attention.kv_lora_rank") is not None:
        caches = [KVTerm(n_kv * key_len)]  # MLA: the latent is cached once, K-only
        kind = "mla"
        index_len = h.get("attention.indexer.key_length")
        if index_len and _indexer_full(h, il):
            caches.append(KVTerm(int(index_len)))
            kind = "mla+indexer"
        return LayerShape(il, kind, weight_bytes, kv=tuple(caches))
    window = int(h.get("attention.sliding_window", 0) or 0) if _is_swa(h, il) else 0
    return LayerShape(il, "sliding" if window else "full", weight_bytes,
                      kv=(KVTerm(n_kv * (key_len + value_len), window=window or None),))


def _is_swa(h: _Header, il: int) -> bool:
    if not h.get("attention.sliding_window") or h.arch in SWA_IGNORED:
        return False
    pattern = h.get("attention.sliding_window_pattern")
    if isinstance(pattern, Sequence) and not isinstance(pattern, str | bytes):
        return bool(pattern[il]) if il < len(pattern) else False
    period = int(pattern) if pattern is not None else SWA_DEFAULT_PERIOD.get(h.arch, 0)
    # llama_hparams::set_swa_pattern: period 0 means every layer slides; else the last of each period is global
    return period == 0 or il % period < period - 1


def _is_recurrent(h: _Header, il: int) -> bool:
    explicit = h.get("attention.recurrent_layers")
    if explicit is not None:
        return bool(_per_layer(explicit, il, False))
    interval = h.get("full_attention_interval") or RECURRENT_DEFAULT_INTERVAL.get(h.arch)
    if interval:
        return (il + 1) % int(interval) != 0
    return h.get("ssm.state_size") is not None and h.get("attention.head_count_kv") in (None, 0)


def _recurrent_state(h: _Header) -> int:
    d_conv = int(h.get("ssm.conv_kernel", 0) or 0)
    d_inner = int(h.get("ssm.inner_size", 0) or 0)
    d_state = int(h.get("ssm.state_size", 0) or 0)
    n_group = int(h.get("ssm.group_count", 0) or 0)
    conv = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    return conv + d_state * d_inner


GLM52_CONTEXT = 1048576
"""glm-dsa GGUFs without ``attention.indexer.types`` are GLM-5.2 (IndexShare) when trained for 1M tokens."""


def glm52_indexer_types(n_layers: int) -> list[bool]:
    """GLM-5.2's published schedule (zai-org/GLM-5.2 config.json, copied into llama.cpp glm-dsa.cpp): full
    indexers on layers 0, 1, 2 and every 4th layer from 2; the layers between reuse their top-k."""
    return [il < 3 or (il - 2) % 4 == 0 for il in range(n_layers)]


def _indexer_types(h: _Header) -> Sequence[Any] | None:
    types = h.get("attention.indexer.types")
    if types is None and h.arch == "glm-dsa" and int(h.get("context_length", 0) or 0) >= GLM52_CONTEXT:
        return glm52_indexer_types(int(h.get("block_count", 0)))
    return types if isinstance(types, Sequence) and not isinstance(types, str | bytes) else None


def _indexer_full(h: _Header, il: int) -> bool:
    types = _indexer_types(h)
    return True if types is None else bool(_per_layer(types, il, 1))


def _dsv4_layer(h: _Header, il: int, weight_bytes: int) -> LayerShape:
    head_dim = int(h.get("attention.key_length", 512))
    index_dim = int(h.get("attention.indexer.key_length", 128))
    raw = KVTerm(head_dim, window=int(h.get(DSV4_RAW_ROWS_KEY, 128)))
    ratio = int(_per_layer(h.get("attention.compress_ratios"), il, 0))
    if ratio == 0:
        return LayerShape(il, "sliding", weight_bytes, kv=(raw,))
    coff = 2 if ratio == 4 else 1  # ratio-4 compressors overlap two blocks, so their frontier is twice as wide
    state = 2 * (coff * head_dim) * (coff * ratio)  # kv + score rows of the unfinished block
    caches = [raw, KVTerm(head_dim, tokens_per_row=ratio)]
    if ratio == 4:
        caches.append(KVTerm(index_dim, tokens_per_row=ratio))
        state += 2 * (coff * index_dim) * (coff * ratio)
    kind = "compressed-sparse" if ratio == 4 else "heavily-compressed"
    return LayerShape(il, kind, weight_bytes, kv=tuple(caches), state_elements=state)


def _groups(h: _Header, n_layers: int) -> tuple[LayerGroup, ...]:
    groups = list(_swa_groups(h, n_layers))
    hash_layers = int(h.get("hash_layer_count", 0) or 0)
    if hash_layers > 1:
        groups.append(LayerGroup(0, hash_layers, True, "hash-routed MoE layers pick experts from the token id, "
                                 "which only the head has", carry_bytes=4))
    types = _indexer_types(h)
    if types is not None:
        top_k = int(h.get("attention.indexer.top_k", 0) or 0)
        groups.extend(indexer_share_groups([bool(t) for t in types[:n_layers]], carry_bytes=4 * top_k))
    return tuple(groups)


def indexer_share_groups(full: Sequence[bool], carry_bytes: int = 0) -> list[LayerGroup]:
    """A "full" indexer layer and the "shared" layers after it reuse one top-k: keep each run on one node (cutting
    one means shipping the top-k, ``carry_bytes`` per position, with the hidden state)."""
    groups: list[LayerGroup] = []
    starts = [il for il, is_full in enumerate(full) if is_full] + [len(full)]
    for start, end in zip(starts, starts[1:], strict=False):
        if end - start > 1:
            groups.append(LayerGroup(start, end, True, "shared-indexer layers reuse the top-k of the full indexer "
                                     f"at layer {start}", carry_bytes))
    return groups


def _swa_groups(h: _Header, n_layers: int) -> list[LayerGroup]:
    """Soft groups ending at each global layer: a shard cut elsewhere must carry an explicit per-layer pattern."""
    if h.arch == "deepseek4" or h.arch in SWA_IGNORED or not h.get("attention.sliding_window"):
        return []
    globals_ = [il for il in range(n_layers) if not _is_swa(h, il)]
    if not globals_ or len(globals_) == n_layers:
        return []
    ends = [g + 1 for g in globals_]
    if ends[-1] != n_layers:
        ends.append(n_layers)
    reason = ("splits the sliding-window pattern: the shard GGUF must carry the per-layer "
              "attention.sliding_window_pattern array, or llama.cpp re-derives it from the new layer index")
    return [LayerGroup(start, end, False, reason) for start, end in zip([0, *ends], ends, strict=False)
            if end - start > 1]
