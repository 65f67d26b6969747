"""One contiguous layer range of a transformers causal LM, built from transformers' own modules.

The whole model is laid out on the ``meta`` device (no memory), then only this range's modules are given real
tensors: the token embeddings on the head, decoder layers ``[start, end)``, the final norm and LM head on the tail.
Layers keep their *global* index, so each one picks its own attention kind (sliding or full), rotary base and
cache slot exactly as in the full model. A session's cache is a transformers ``DynamicCache`` laid out for every
layer, in which foreign layers are ``DummyLayer`` placeholders that hold nothing (and raise if ever written) and
windowed layers are ``kv.WindowLayer`` (transformers' sliding-window layer, with an optional rollback margin).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.cache_utils import DummyLayer, DynamicCache, DynamicLayer, get_layer_types_and_kwargs
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from actors.backends.torch.kv import KvLayout, LayerSpec, WindowLayer
from actors.backends.torch.store import TensorSource
from schemas.errors import BackendError

_MASKS: dict[str, Any] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,
}


class Shard:
    """The modules of layers ``[start, end)`` and the forward pass through them."""

    def __init__(self, config: PretrainedConfig, start: int, end: int, tensors: TensorSource,
                 dtype: torch.dtype = torch.float32) -> None:
        self.n_layers = int(config.num_hidden_layers)
        if not 0 <= start < end <= self.n_layers:
            raise ValueError(f"layer range [{start}, {end}) not within 0..{self.n_layers}")
        self.start, self.end, self.dtype = start, end, dtype
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, attn_implementation="sdpa", dtype=dtype)
        self.config = skeleton.config
        base = getattr(skeleton, skeleton.base_model_prefix)
        for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(base, attr):
                raise BackendError(f"torch backend: {type(skeleton).__name__} has no {attr}; architecture unsupported")
        prefix = f"{skeleton.base_model_prefix}."
        self.layer_types, layer_kwargs = get_layer_types_and_kwargs(self.config)
        self.windows = {i: int(layer_kwargs[i].get("sliding_window") or 0) for i in range(start, end)}
        """Per own layer, its attention window (sliding or chunked); 0 for full attention."""
        unsupported = {self.layer_types[i] for i in range(start, end)} - set(_MASKS)
        if unsupported:
            raise BackendError(f"torch backend: layer kinds {sorted(unsupported)} are not supported")

        tied = bool(self.config.get_text_config().tie_word_embeddings)
        wanted: dict[str, tuple[nn.Module, str]] = {f"layer{i}": (base.layers[i], f"{prefix}layers.{i}.")
                                                    for i in range(start, end)}
        if self.is_head:
            wanted["embed"] = (base.embed_tokens, f"{prefix}embed_tokens.")
        if self.is_tail:
            wanted["norm"] = (base.norm, f"{prefix}norm.")
            if not (tied and self.is_head):
                wanted["lm_head"] = (skeleton.get_output_embeddings(), f"{prefix}embed_tokens." if tied else "lm_head.")
        built = _materialize(wanted, tensors, dtype)
        self.embed: nn.Module | None = built.get("embed")
        self.layers = {i: built[f"layer{i}"] for i in range(start, end)}
        self.norm: nn.Module | None = built.get("norm")
        self.lm_head: nn.Module | None = built.get("lm_head")
        if self.is_tail and self.lm_head is None:
            # Tied and also the head: share the one matrix rather than holding it twice.
            self.lm_head = skeleton.get_output_embeddings()
            self.lm_head.weight = self.embed.weight  # type: ignore[union-attr]
        # Rotary tables are computed, not loaded: build them for real instead of materializing the meta copy.
        self.rotary = type(base.rotary_emb)(config=self.config)
        self._rotary_by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self._kinds = sorted({self.layer_types[i] for i in range(start, end)})
        self._first_of_kind = {k: min(i for i in range(start, end) if self.layer_types[i] == k) for k in self._kinds}
        del skeleton, base

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.n_layers

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def new_cache(self, rollback: int = 0) -> DynamicCache:
        """A per-session KV cache for this range only; foreign layers are empty placeholders. Windowed layers keep
        ``rollback`` positions beyond their window so that the session can be truncated that far back."""
        cache = DynamicCache(config=self.config)
        for i in range(self.n_layers):
            if not self.start <= i < self.end:
                cache.layers[i] = DummyLayer()  # type: ignore[no-untyped-call]
            elif self.windows[i]:
                cache.layers[i] = WindowLayer(self.windows[i], rollback)
        return cache

    def kv_layout(self, tag: bytes) -> KvLayout:
        """What this shard's KV blobs hold (``kv.export``), for the model named by the 8-byte ``tag``."""
        cfg = self.config
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        layers = tuple(LayerSpec(index=i, window=self.windows[i], kv_heads=kv_heads, k_dim=head_dim, v_dim=head_dim)
                       for i in range(self.start, self.end))
        return KvLayout(tag=tag, start=self.start, end=self.end, n_layers=self.n_layers, dtype=self.dtype,
                        layers=layers)

    def embed_tokens(self, tokens: list[int]) -> torch.Tensor:
        if self.embed is None:
            raise BackendError("this shard has no embeddings (not the head)")
        with torch.inference_mode():
            out: torch.Tensor = self.embed(torch.tensor([tokens], dtype=torch.long))
        return out

    def forward(self, hidden: torch.Tensor, start_position: int, cache: DynamicCache | None) -> torch.Tensor:
        """Run ``hidden`` (``(1, n, hidden_size)``, positions ``start_position..``) through the layers.

        With a cache, its layers are appended to; without one (the benchmark's recompute baseline) the call must
        carry the whole sequence from position 0.
        """
        hidden = hidden.to(self.dtype)
        n = hidden.shape[1]
        positions = torch.arange(start_position, start_position + n, dtype=torch.long).unsqueeze(0)
        with torch.inference_mode():
            # Masks read each kind's cache length, so build them all before any layer appends to the cache.
            masks = {kind: _MASKS[kind](config=self.config, inputs_embeds=hidden, attention_mask=None, cache=cache,
                                        position_ids=positions,
                                        layer_idx=self._first_of_kind[kind] if cache is not None else None)
                     for kind in self._kinds}
            rope = {kind: self._rope(hidden, positions, kind) for kind in self._kinds}
            for i, layer in self.layers.items():
                kind = self.layer_types[i]
                out = layer(hidden, attention_mask=masks[kind], position_embeddings=rope[kind],
                            position_ids=positions, cache=cache)
                hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def _rope(self, hidden: torch.Tensor, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rotary_by_type:
            return self.rotary(hidden, positions, kind)  # type: ignore[no-any-return]
        return self.rotary(hidden, positions)  # type: ignore[no-any-return]

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32, shape ``(vocab,)``) for one position's final hidden state ``(hidden_size,)``."""
        if self.norm is None or self.lm_head is None:
            raise BackendError("this shard has no LM head (not the tail)")
        with torch.inference_mode():
            logits: torch.Tensor = self.lm_head(self.norm(hidden_last.to(self.dtype).view(1, 1, -1)))[0, 0].float()
            softcap = getattr(self.config, "final_logit_softcapping", None)
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
        return logits

    def modules(self) -> list[nn.Module]:
        """Every module holding this shard's weights."""
        return [m for m in (self.embed, self.norm, self.lm_head) if m is not None] + list(self.layers.values())

    def parameter_bytes(self) -> int:
        """Bytes of weights this shard holds (a tied head shared with the embeddings counts once).

        Weights read from the safetensors cache stay file-backed (memory-mapped): pages become resident as the
        forward pass touches them, and nodes on one machine share them through the page cache.
        """
        seen: dict[int, int] = {}
        for module in self.modules():
            for p in module.parameters():
                seen[p.data_ptr()] = p.numel() * p.element_size()
        return sum(seen.values())


def cache_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            for tensor in (layer.keys, layer.values):
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
    return total


def _materialize(wanted: dict[str, tuple[nn.Module, str]], tensors: TensorSource,
                 dtype: torch.dtype) -> dict[str, nn.Module]:
    """Give meta modules real tensors, each read under its prefix, in one read; nothing else is touched."""
    names = {key: list(module.state_dict().keys()) for key, (module, _) in wanted.items()}
    loaded = tensors.read([prefix + n for key, (_, prefix) in wanted.items() for n in names[key]])
    for key, (module, prefix) in wanted.items():
        state = {n: _cast(loaded.pop(prefix + n), dtype) for n in names[key]}
        module.load_state_dict(state, strict=True, assign=True)
        _fill_buffers(module)
        module.eval()
    return {key: module for key, (module, _) in wanted.items()}


def _fill_buffers(module: nn.Module) -> None:
    """Non-persistent buffers are not in checkpoints: recompute the ones we know, refuse the rest."""
    for owner_name, owner in module.named_modules():
        for buffer_name, buffer in list(owner.named_buffers(recurse=False)):
            if buffer.device.type != "meta":
                continue
            if buffer_name == "embed_scale" and hasattr(owner, "scalar_embed_scale"):
                owner.embed_scale = torch.tensor(float(owner.scalar_embed_scale))
            else:
                raise BackendError(f"torch backend: cannot materialize buffer {owner_name}.{buffer_name}")


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor
