"""The torch backend: the reference implementation of a route hop, on transformers' own decoder layers.

Each node holds one layer range (``Shard``) and, per Route Session, a transformers cache for those layers only.
A prefill chunk or a decode step runs its positions through the range once, appending to that cache; the wire
carries float32 hidden states of just those positions. The tail turns the last position into logits and samples.
Items of a batch run one after another: sessions never share a forward pass, so they cannot leak into each other.

Issue #19: n > 1 forks deep-copy the session's cache (choice ``i`` samples with ``seed + i``), and logprobs are the
log-softmax of the raw logits. Output constraints (grammars) are refused: llama.cpp's grammar sampler is the only
one swarmroute has.

Issue #27: the head reports where a reply starts relative to a think block (``reasoning_start``, from its chat
template and the prompt's last tokens, as llama.cpp heads do), so the gateway splits reasoning from the answer.

Issue #18: a session's KV leaves and re-enters as blobs of raw cache tensors (``actors.backend.KvBackend``, the
cache handling in ``kv``); windowed layers keep ``kv_rollback`` positions beyond their window so that truncation
can go back that far.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from actors.backend import Hidden, StepInput, StepOutput, TopLogits
from actors.backends.session_table import HoldsSessions, SessionTable, choice_seed
from actors.backends.torch import kv
from actors.backends.torch.models import TINY_MODELS, PreparedModel, prepare
from actors.backends.torch.sampler import TorchSampler, token_logprobs
from actors.backends.torch.shard import Shard, cache_bytes
from actors.backends.torch.tokens import TokenCodec
from schemas.errors import (
    BackendError,
    BadRequestError,
    ContextLengthError,
    FrameError,
    PayloadTooLargeError,
    SnapshotError,
    SwarmrouteError,
)
from schemas.node import BackendInfo, LayerRange
from schemas.reasoning import ReasoningStart, prompt_reasoning_start
from schemas.session import Prompt, SamplingParams

_DTYPES = {"float32": torch.float32, "f32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "f16": torch.float16}


@dataclasses.dataclass
class TorchConfig:
    model: str = "tiny-llama"
    """``tiny-llama`` / ``tiny-gemma3`` (seeded random weights), a ``.gguf`` file, or a transformers directory."""

    layer_start: int = 0
    layer_end: int | None = None
    """This node's range ``[layer_start, layer_end)``; ``None`` means to the last layer."""

    max_sessions: int = 8
    """Sessions that may hold KV at once."""

    context_length: int = 4096
    """Tokens per session (capped by the model's ``max_position_embeddings``)."""

    dtype: str = "float32"
    """Weights and compute: float32 (exact reference), bfloat16 or float16. The wire is float32 regardless."""

    max_batch_tokens: int = 4096
    """Most positions one ``step`` may carry across all its items."""

    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""

    cache_dir: Path | None = None
    """Where converted and tiny models are cached; default ``<SWARMROUTE_HOME>/torch``."""

    seed: int = 0
    """Seed of the tiny models' random weights (every node of a route must use the same)."""

    kv_rollback: int = 0
    """Positions sliding-window layers keep beyond the ``window - 1`` the next position reads, so that ``truncate``
    (a repair's cut, a rejected draft) can go back that far; 0 keeps exactly the window."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {sorted(_DTYPES)}")
        if self.max_sessions < 1 or self.context_length < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_sessions, context_length and max_batch_tokens must be positive")
        if self.kv_rollback < 0:
            raise ValueError("kv_rollback must be 0 or more")
        if self.cache_dir is None:
            from schemas.settings import Settings

            self.cache_dir = Settings().home / "torch"
        self.cache_dir = Path(self.cache_dir)


@dataclasses.dataclass
class _Session:
    cache: DynamicCache
    position: int = 0
    sampler: TorchSampler | None = None
    sampling: SamplingParams | None = None
    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    last_logits: torch.Tensor | None = None
    """Tail: the logits the last sample was drawn from (forks draw their first token from them)."""


class TorchBackend(HoldsSessions[_Session]):
    def __init__(self, config: TorchConfig, prepared: PreparedModel) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.prepared = prepared
        n_layers = int(prepared.config.num_hidden_layers)
        end = n_layers if config.layer_end is None else config.layer_end
        started = time.perf_counter()
        self.shard = Shard(prepared.config, config.layer_start, end, prepared.tensors, _DTYPES[config.dtype])
        self.load_seconds = time.perf_counter() - started
        self._layers = LayerRange(start=config.layer_start, end=end)
        self._kv_layout = self.shard.kv_layout(_model_tag(prepared, config))
        self._context = min(config.context_length, int(getattr(prepared.config, "max_position_embeddings",
                                                               config.context_length)))
        self.codec: TokenCodec | None = None
        if self.shard.is_head or self.shard.is_tail:
            eos = prepared.config.eos_token_id
            extra = list(eos) if isinstance(eos, list | tuple) else [eos]
            self.codec = TokenCodec.load(prepared.tokenizer_dir(), extra)
        self._sessions = SessionTable[_Session]("torch", config.max_sessions, tail=self.is_tail, constraints=False)
        self._lock = threading.Lock()

    @property
    def info(self) -> BackendInfo:
        import transformers

        cfg = self.prepared.config
        return BackendInfo(kind="torch", model_name=self.prepared.name, architecture=str(cfg.model_type),
                           file_type=self.config.dtype, n_layers=self.shard.n_layers,
                           hidden_size=self.shard.hidden_size, hidden_shape=[self.shard.hidden_size],
                           n_vocab=int(cfg.vocab_size), context_length=self._context, threads=torch.get_num_threads(),
                           version=f"torch {torch.__version__}, transformers {transformers.__version__}",
                           artifact_sha256=self.prepared.sha256, wire_dtype="f32")

    @property
    def layers(self) -> LayerRange:
        return self._layers

    @property
    def is_head(self) -> bool:
        return self.shard.is_head

    @property
    def is_tail(self) -> bool:
        return self.shard.is_tail

    @property
    def max_batch_tokens(self) -> int:
        return self.config.max_batch_tokens

    def _codec(self) -> TokenCodec:
        if self.codec is None:
            raise BadRequestError("only the head tokenizes and only the tail detokenizes")
        return self.codec

    def tokenize(self, prompt: Prompt) -> list[int]:
        if not self.is_head:
            raise BadRequestError("only the head node tokenizes")
        if prompt.tools is not None:
            raise BadRequestError("the torch backend does not render tools; serve a llamacpp model for them",
                                  param="tools")
        return self._codec().tokenize(prompt)

    def reasoning_start(self, prompt_tokens: list[int]) -> ReasoningStart | None:
        """Head: where a reply to this prompt starts relative to a think block, read from its chat template and
        the prompt's last tokens as every head reads it (``schemas.reasoning``); ``None`` without a template that
        marks reasoning (issue #27)."""
        if not self.is_head or self.codec is None:
            return None
        return prompt_reasoning_start(self.codec.template_source, prompt_tokens, self.codec.token_bytes)

    def open_session(self, session_id: str, *, prompt_tokens: list[int], sampling: SamplingParams) -> None:
        if len(prompt_tokens) >= self._context:
            raise ContextLengthError(f"prompt has {len(prompt_tokens)} tokens; this node serves {self._context}")
        with self._lock:
            self._sessions.admit(session_id, sampling)
            sampler = TorchSampler(sampling, prompt_tokens) if self.is_tail else None
            cache = self.shard.new_cache(self.config.kv_rollback)
            self._sessions.add(session_id, _Session(cache=cache, sampler=sampler, sampling=sampling,
                                                    prompt_tokens=list(prompt_tokens) if self.is_tail else []))

    def fork_session(self, session_id: str, fork_ids: list[str]) -> list[StepOutput]:
        """n > 1 (``actors.backend.ForkingBackend``): each fork gets a deep copy of the session's cache; on the tail,
        choice ``i`` samples with ``seed + i``, its first token from the session's last logits."""
        with self._lock:
            source = self._sessions[session_id]

            def make(choice: int) -> _Session:
                fork = _Session(cache=copy.deepcopy(source.cache), position=source.position,
                                sampling=source.sampling, prompt_tokens=source.prompt_tokens)
                if self.is_tail:
                    assert source.sampling is not None
                    fork.sampler = TorchSampler(source.sampling, source.prompt_tokens,
                                                seed=choice_seed(source.sampling.seed, choice))
                return fork

            def first(fork: _Session) -> StepOutput:
                assert source.last_logits is not None
                return self._pick(fork, source.last_logits)

            return self._sessions.fork(fork_ids, make, first, sampled=source.last_logits is not None)

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        total = sum(item.n_positions for item in batch)
        if total > self.config.max_batch_tokens:
            raise PayloadTooLargeError(f"batch carries {total} positions (max {self.config.max_batch_tokens})")
        if len({item.session_id for item in batch}) != len(batch):
            raise FrameError("a batch may carry at most one step per session")
        sessions = [self._sessions[item.session_id] for item in batch]
        # Validate everything first: a bad item must not leave other sessions' caches advanced without output.
        for item, s in zip(batch, sessions, strict=True):
            self._check(item, s)
        self._sessions.check_step_forks([f for item in batch for f in item.forks])
        outputs = [self._step_one(item, s) for item, s in zip(batch, sessions, strict=True)]
        for item, out in zip(batch, outputs, strict=True):
            if item.forks:
                out.forks = self.fork_session(item.session_id, list(item.forks))
        return outputs

    def _step_one(self, item: StepInput, s: _Session) -> StepOutput:
        try:
            if item.tokens is not None:
                hidden = self.shard.embed_tokens(item.tokens)
            else:
                assert item.hidden is not None
                hidden = torch.from_numpy(np.array(item.hidden, dtype=np.float32, copy=True)).unsqueeze(0)
            hidden = self.shard.forward(hidden, item.start_position, s.cache)
        except SwarmrouteError:
            raise
        except Exception as exc:  # torch raises RuntimeError for shape/memory problems; report, don't crash
            # Some layers may have appended to the cache already: the session cannot continue consistently.
            self.close_session(item.session_id)
            raise BackendError(f"torch forward failed: {exc}") from exc
        s.position += item.n_positions
        if not self.is_tail:
            out: Hidden = hidden[0].to(torch.float32).numpy()
            return StepOutput(hidden=out)
        if item.rows:  # a verify window (issue #20): every position's logits, for the node to judge
            rows = np.stack([self.shard.logits(hidden[0, i]).numpy() for i in range(item.n_positions)])
            return StepOutput(rows=rows.astype(np.float32))
        if not item.sample:
            return StepOutput()
        s.last_logits = self.shard.logits(hidden[0, -1])
        picked = self._pick(s, s.last_logits)
        if item.top_k:
            picked.top = TopLogits.of(s.last_logits.to(torch.float32).numpy(), item.top_k)
        return picked

    def _pick(self, s: _Session, logits: torch.Tensor) -> StepOutput:
        assert s.sampler is not None
        token = s.sampler.sample(logits)
        n_top = s.sampler.params.logprobs
        return StepOutput(token=token, logprobs=None if n_top is None else token_logprobs(logits, token, n_top))

    def _check(self, item: StepInput, s: _Session) -> None:
        if item.start_position != s.position:
            raise FrameError(f"expected position {s.position} for session {item.session_id}, "
                             f"got {item.start_position}")
        if item.n_positions < 1:
            raise FrameError("a step needs at least one position")
        if item.start_position + item.n_positions > self._context:
            raise ContextLengthError(f"position {item.start_position + item.n_positions} exceeds the context "
                                     f"({self._context})")
        if self.is_head:
            if item.tokens is None:
                raise FrameError("the head takes token ids, not hidden states")
            vocab = int(self.prepared.config.vocab_size)
            if any(not 0 <= t < vocab for t in item.tokens):
                raise BadRequestError(f"token id outside the vocabulary (0..{vocab - 1})")
            return
        if item.hidden is None:
            raise FrameError("this node is not the head: it takes hidden states, not token ids")
        if tuple(item.hidden.shape[1:]) != (self.shard.hidden_size,):
            raise FrameError(f"hidden states have shape {tuple(item.hidden.shape)}; expected (n, "
                             f"{self.shard.hidden_size})")

    def last_logits(self, session_id: str) -> torch.Tensor:
        """Tail: a copy of the logits the session's last sample was drawn from (tests compare them bit for bit)."""
        with self._lock:
            logits = self._sessions[session_id].last_logits
        if logits is None:
            raise BadRequestError(f"session {session_id} has sampled nothing since its KV last changed")
        return logits.clone()

    def token_bytes(self, token: int) -> bytes:
        return self._codec().token_bytes(token)

    def is_end_of_generation(self, token: int) -> bool:
        return self._codec().is_end_of_generation(token)

    def close_session(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id)

    def kv_bytes_in_use(self) -> int:
        with self._lock:
            sessions = list(self._sessions.values())
        return sum(cache_bytes(s.cache) for s in sessions)

    # ---- KV in and out (``actors.backend.KvBackend``; the cache handling is ``kv``'s) ----------------------------

    def export_kv(self, session_id: str, start: int, end: int) -> bytes:
        """The raw cache tensors of positions ``[start, end)`` of this node's layers; a windowed layer's hold only
        what it still keeps of that range (``kv``)."""
        with self._lock:
            s = self._sessions.exporting(session_id, start, end)
            return kv.export(s.cache, self._kv_layout, start, end)

    def import_kv(self, session_id: str, blobs: list[bytes], end: int) -> None:
        with self._lock:
            s = self._sessions[session_id]
            if end > self._context:
                raise SnapshotError(f"KV blobs up to position {end} exceed this node's context ({self._context})")
            kv.load(s.cache, self._kv_layout, s.position, blobs, end)
            s.position = end
            s.last_logits = None  # they were not this cache's: a fork must sample first

    def truncate(self, session_id: str, position: int) -> None:
        with self._lock:
            s = self._sessions.truncating(session_id, position)
            kv.truncate(s.cache, self._kv_layout, position)
            if position < s.position:
                s.position = position
                s.last_logits = None

    def kv_continues(self, session_id: str) -> bool:
        with self._lock:
            s = self._sessions[session_id]
            return kv.reusable(s.cache, self._kv_layout, s.position, s.position) == s.position

    def reusable_prefix(self, source_id: str, length: int) -> int:
        with self._lock:
            s = self._sessions[source_id]
            return kv.reusable(s.cache, self._kv_layout, s.position, length)

    def copy_prefix(self, source_id: str, session_id: str, length: int) -> None:
        with self._lock:
            source, s = self._sessions[source_id], self._sessions[session_id]
            if s.position or source_id == session_id:
                raise BadRequestError(f"session {session_id} already holds {s.position} positions")
            if length <= 0 or kv.reusable(source.cache, self._kv_layout, source.position, length) != length:
                raise BadRequestError(f"session {source_id} (at {source.position}) cannot lend its first {length} "
                                      "positions: a windowed layer no longer holds what continuing from there reads")
            kv.copy_prefix(source.cache, s.cache, self._kv_layout, length)
            s.position = length

    def replay_sampled(self, session_id: str, tokens: list[int]) -> None:
        """Tail: a new sampler with the session's seed (as at open) that has accepted ``tokens``. Draw ``k`` of a
        stream depends on its seed and ``k`` only (``TorchSampler``), so a seeded tail continues unchanged; an
        unseeded one keeps the seed the OS gave it at open on this node (a rebuilt tail has a new one)."""
        with self._lock:
            s = self._sessions[session_id]
            if s.sampler is None or s.sampling is None:
                raise BadRequestError("only the tail samples")
            sampler = TorchSampler(s.sampling, s.prompt_tokens, seed=s.sampler.seed)
            for token in tokens:
                sampler.accept(token)
            s.sampler = sampler

    def close(self) -> None:
        with self._lock:
            self._sessions.clear()


def _model_tag(prepared: PreparedModel, config: TorchConfig) -> bytes:
    """8 bytes naming the model in KV blobs: its architecture and dims, the file's digest (GGUF), and a tiny model's
    name and seed. A transformers directory has no digest: the node checks blobs against its model id anyway."""
    cfg = prepared.config
    dims = [str(cfg.model_type), int(cfg.num_hidden_layers), int(cfg.hidden_size), int(cfg.vocab_size)]
    tiny = [prepared.name, config.seed] if prepared.name in TINY_MODELS else []
    return hashlib.sha256(json.dumps([dims, prepared.sha256, tiny]).encode()).digest()[:8]


def load_torch(**options: object) -> TorchBackend:
    """Build a torch backend from keyword options (the fields of ``TorchConfig``)."""
    config = TorchConfig(**options)  # type: ignore[arg-type]
    assert config.cache_dir is not None
    prepared = prepare(config.model, config.cache_dir, seed=config.seed)
    return TorchBackend(config, prepared)
