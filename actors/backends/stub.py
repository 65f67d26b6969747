"""The stub backend: a protocol test double that behaves like a split transformer. Not a model.

Each layer is deterministic arithmetic on a fixed hidden shape, with weights derived from the model id and the
*global* layer index, so any split of the layers across nodes computes exactly what one node computes. Each layer
keeps per-session state (a running sum of its inputs: the stand-in for Hot KV State) that every later position
reads, so an output depends on all earlier positions: a node that lost or recomputed its state produces a different
token stream, which is what the protocol tests look for. ``positions_computed`` counts work per session so a test
can tell a real local cache (prompt + generated positions) from a recompute (quadratic).

Vocabulary: 256 byte tokens, then BOS (256) and EOS (257). Tokenization is UTF-8 bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import numpy as np

from actors.backend import Hidden, StepInput, StepOutput
from schemas.errors import BadRequestError, CapacityError, SessionNotFoundError
from schemas.node import BackendInfo, LayerRange
from schemas.session import Prompt, SamplingParams

BOS, EOS, VOCAB = 256, 257, 258


@dataclasses.dataclass
class StubConfig:
    model: str = "stub-model"
    """Model id; seeds every weight, so nodes agree without sharing files."""

    n_layers: int = 8
    """Layers of the whole model."""

    layer_start: int = 0
    layer_end: int | None = None
    """This node's range ``[layer_start, layer_end)``; ``None`` means to the last layer."""

    hidden_shape: tuple[int, ...] = (64,)
    """Per-position hidden state; several dims model multi-stream residuals (e.g. ``(4, 64)``)."""

    context_length: int = 4096
    max_sessions: int = 16
    max_batch_tokens: int = 4096
    delay_s: float = 0.0
    """Artificial compute time per step, for failure tests that need a slow node."""

    def __post_init__(self) -> None:
        self.hidden_shape = tuple(int(d) for d in self.hidden_shape)
        if self.layer_end is None:
            self.layer_end = self.n_layers
        if not 0 <= self.layer_start < self.layer_end <= self.n_layers:
            raise ValueError(f"layer range [{self.layer_start}, {self.layer_end}) not within 0..{self.n_layers}")


def _rng(model: str, *parts: object) -> np.random.Generator:
    digest = hashlib.sha256("/".join([model, *map(str, parts)]).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


@dataclasses.dataclass
class _Session:
    position: int = 0
    sums: dict[int, Hidden] = dataclasses.field(default_factory=dict)
    rng: np.random.Generator | None = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    positions_computed: int = 0


class StubBackend:
    def __init__(self, config: StubConfig) -> None:
        assert config.layer_end is not None
        self.config = config
        self._layers = LayerRange(start=config.layer_start, end=config.layer_end)
        self._dim = int(np.prod(config.hidden_shape))
        scale = np.sqrt(self._dim)
        self._weights = {il: (_rng(config.model, "layer", il).standard_normal((self._dim, self._dim)) / scale)
                         .astype(np.float32) for il in range(config.layer_start, config.layer_end)}
        self._embed = _rng(config.model, "embed").standard_normal((VOCAB, self._dim)).astype(np.float32)
        self._unembed = _rng(config.model, "unembed").standard_normal((self._dim, VOCAB)).astype(np.float32)
        # Only printable ASCII, newline and EOS can be sampled, so stub text is valid UTF-8 and readable in tests;
        # EOS is damped to keep streams long without forbidding it.
        self._mask = np.full(VOCAB, -np.inf)
        self._mask[[10, *range(32, 127)]] = 0.0
        self._mask[EOS] = -6.0
        self._sessions: dict[str, _Session] = {}
        self.closed_positions: dict[str, int] = {}
        """positions_computed of each closed session, kept so tests can check work after the session ended."""
        self._lock = threading.Lock()

    @property
    def info(self) -> BackendInfo:
        c = self.config
        return BackendInfo(kind="stub", model_name=c.model, architecture="stub", file_type="f32", n_layers=c.n_layers,
                           hidden_size=c.hidden_shape[-1], hidden_shape=list(c.hidden_shape), n_vocab=VOCAB,
                           context_length=c.context_length, threads=1, version="stub-1")

    @property
    def layers(self) -> LayerRange:
        return self._layers

    @property
    def is_head(self) -> bool:
        return self._layers.start == 0

    @property
    def is_tail(self) -> bool:
        return self._layers.end == self.config.n_layers

    @property
    def max_sessions(self) -> int:
        return self.config.max_sessions

    @property
    def max_batch_tokens(self) -> int:
        return self.config.max_batch_tokens

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            text = "".join(f"<{m.get('role')}>{m.get('content')}\n" for m in prompt.messages)
            text += "<assistant>" if prompt.add_generation_prompt else ""
        elif prompt.text is not None:
            text = prompt.text
        else:
            raise BadRequestError("prompt has neither text nor messages")
        return [BOS, *text.encode()]

    def open_session(self, session_id: str, *, prompt_tokens: list[int], sampling: SamplingParams) -> None:
        with self._lock:
            if session_id in self._sessions:
                raise BadRequestError(f"session {session_id} is already open on this node")
            if len(self._sessions) >= self.config.max_sessions:
                raise CapacityError(f"stub node holds {len(self._sessions)} sessions (max {self.config.max_sessions})")
            rng = np.random.default_rng(sampling.seed) if sampling.seed is not None else np.random.default_rng()
            self._sessions[session_id] = _Session(rng=rng, sampling=sampling)

    def _session(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionNotFoundError(f"session {session_id} is not open on this node") from None

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        if self.config.delay_s:
            import time

            time.sleep(self.config.delay_s)
        return [self._step_one(item) for item in batch]

    def _step_one(self, item: StepInput) -> StepOutput:
        s = self._session(item.session_id)
        if item.start_position != s.position:
            raise BadRequestError(f"stub expected position {s.position}, got {item.start_position}")
        if item.tokens is not None:
            if any(not 0 <= t < VOCAB for t in item.tokens):
                raise BadRequestError(f"token id outside the stub vocabulary (0..{VOCAB - 1})")
            x = self._embed[np.asarray(item.tokens)]
        else:
            assert item.hidden is not None
            x = item.hidden.reshape(item.hidden.shape[0], self._dim).astype(np.float32)
        out = np.empty_like(x)
        for row in range(x.shape[0]):
            h = x[row]
            for il in range(self._layers.start, self._layers.end):
                total = s.sums.get(il)
                total = h.copy() if total is None else total + h
                s.sums[il] = total
                h = np.tanh(self._weights[il] @ h + 0.5 * total / (s.position + row + 1)).astype(np.float32)
            out[row] = h
        s.position += x.shape[0]
        s.positions_computed += x.shape[0]
        if not self.is_tail:
            return StepOutput(hidden=out.reshape((x.shape[0], *self.config.hidden_shape)))
        return StepOutput(token=self._sample(s, out[-1]) if item.sample else None)

    def _sample(self, s: _Session, h: Hidden) -> int:
        logits = (h @ self._unembed).astype(np.float64) + self._mask
        p = s.sampling
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        assert s.rng is not None
        logits = logits / p.temperature
        probs = np.exp(logits - logits.max())  # exp(-inf) = 0 keeps masked tokens out
        probs /= probs.sum()
        if p.top_k:
            cutoff = np.sort(probs)[-min(p.top_k, VOCAB)]
            probs = np.where(probs >= cutoff, probs, 0.0)
            probs /= probs.sum()
        return int(s.rng.choice(VOCAB, p=probs))

    def positions_computed(self, session_id: str) -> int:
        return self._session(session_id).positions_computed

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if 0 <= token < 256 else b""

    def is_end_of_generation(self, token: int) -> bool:
        return token == EOS

    def close_session(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self.closed_positions[session_id] = session.positions_computed

    def kv_bytes_in_use(self) -> int:
        return sum(len(s.sums) * self._dim * 4 for s in self._sessions.values())

    @property
    def open_sessions(self) -> list[str]:
        return list(self._sessions)

    def close(self) -> None:
        self._sessions.clear()
