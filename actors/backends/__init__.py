"""Model backends behind the node API. ``load_backend`` picks one by name; heavy ones import lazily."""

from __future__ import annotations

from typing import Any

from actors.backend import Backend


def load_backend(kind: str, **options: Any) -> Backend:
    """Build a backend: ``stub`` (protocol test double), ``llamacpp`` (GGUF), ``torch`` (transformers reference)."""
    if kind == "stub":
        from actors.backends.stub import StubBackend, StubConfig

        return StubBackend(StubConfig(**options))
    if kind == "llamacpp":
        from actors.backends.llamacpp.backend import load_llamacpp

        backend: Backend = load_llamacpp(**options)
        return backend
    if kind == "torch":
        from actors.backends.torch.backend import load_torch

        torch_backend: Backend = load_torch(**options)
        return torch_backend
    raise ValueError(f"unknown backend {kind!r}: expected stub, llamacpp or torch")
