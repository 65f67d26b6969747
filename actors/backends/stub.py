"""The stub backend: a protocol test double that behaves like a split transformer. Not a model.

Each layer is deterministic arithmetic on a fixed hidden shape, with weights derived from the model id and the
*global* layer index, so any split of the layers across nodes computes exactly what one node computes. Each layer
keeps per-session state (a running sum of its inputs: the stand-in for Hot KV State) that every later position
reads, so an output depends on all earlier positions: a node that lost or recomputed its state produces a different
token stream, which is what the protocol tests look for. ``positions_computed`` counts work per session so a test
can tell a real local cache (prompt + generated positions) from a recompute (quadratic).

Vocabulary: 256 byte tokens, then BOS (256) and EOS (257). Tokenization is UTF-8 bytes.

Issue #19: logprobs (log-softmax of the stub's logits) and n > 1 forks (the running sums are copied; choice ``i``
draws with ``seed + i``) behave as on llama.cpp, so the protocol tests can exercise them. Output constraints are
refused: a grammar over this toy vocabulary would test nothing real.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import threading

import numpy as np
import numpy.typing as npt

from actors.backend import Hidden, StepInput, StepOutput, TopLogits
from actors.backends.session_table import HoldsSessions, SessionTable, Wording, choice_seed
from schemas.errors import BadRequestError, SnapshotError
from schemas.node import BackendInfo, LayerRange
from schemas.session import LogprobCandidate, Prompt, SamplingParams, TokenLogprobs

BOS, EOS, VOCAB = 256, 257, 258
_KV_MAGIC = b"SKV1"
_KV_HEAD = struct.Struct("<4sIIIII")
"""A stub KV blob: magic, layer range, position range, hidden size; then float32 sums (layer, position, dim)."""
_WORDING = Wording(export_range="session {session} holds [0, {position}); cannot export [{start}, {end})",
                   truncate_range="session {session} is at {position}; cannot truncate to {to}")


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
    sums: dict[int, list[Hidden]] = dataclasses.field(default_factory=dict)
    """Per layer, the running sum of the layer's inputs after each position (the last is the current one): the
    "KV" a later position reads, kept per position so that it can be exported by range and truncated."""
    rng: np.random.Generator | None = None
    """Unseeded sessions' draws; a seeded session draws from ``(seed, position)`` alone (``StubBackend._sample``)."""
    seed: int | None = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    positions_computed: int = 0
    last_logits: npt.NDArray[np.float64] | None = None
    """The logits the last sample was drawn from (forks draw their first token from them)."""


class StubBackend(HoldsSessions[_Session]):
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
        self._sessions = SessionTable[_Session]("stub", config.max_sessions, tail=self.is_tail, constraints=False,
                                                wording=_WORDING)
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
    def max_batch_tokens(self) -> int:
        return self.config.max_batch_tokens

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.tools is not None:
            raise BadRequestError("the stub backend does not render tools; serve a llamacpp model for them",
                                  param="tools")
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
            self._sessions.admit(session_id, sampling)
            self._sessions.add(session_id, _Session(rng=np.random.default_rng(), seed=sampling.seed,
                                                    sampling=sampling))

    def fork_session(self, session_id: str, fork_ids: list[str]) -> list[StepOutput]:
        """n > 1 (``actors.backend.ForkingBackend``): each fork gets a copy of the running sums; on the tail, choice
        ``i`` draws with ``seed + i`` and samples its first token from the session's last logits."""
        with self._lock:
            return self._fork(self._sessions[session_id], fork_ids)

    def _fork(self, source: _Session, fork_ids: list[str] | tuple[str, ...]) -> list[StepOutput]:
        def make(choice: int) -> _Session:
            return _Session(position=source.position, sums={il: list(v) for il, v in source.sums.items()},
                            rng=np.random.default_rng(), seed=choice_seed(source.sampling.seed, choice),
                            sampling=source.sampling)

        def first(fork: _Session) -> StepOutput:
            assert source.last_logits is not None
            return self._pick(fork, source.last_logits)

        return self._sessions.fork(fork_ids, make, first, sampled=source.last_logits is not None)

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        if self.config.delay_s:
            import time

            time.sleep(self.config.delay_s)
        outputs = [self._step_one(item) for item in batch]
        for item, out in zip(batch, outputs, strict=True):
            if item.forks:
                with self._lock:
                    out.forks = self._fork(self._sessions[item.session_id], item.forks)
        return outputs

    def _step_one(self, item: StepInput) -> StepOutput:
        s = self._sessions[item.session_id]
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
                history = s.sums.setdefault(il, [])
                total = h.copy() if not history else history[-1] + h
                history.append(total)
                h = np.tanh(self._weights[il] @ h + 0.5 * total / (s.position + row + 1)).astype(np.float32)
            out[row] = h
        s.position += x.shape[0]
        s.positions_computed += x.shape[0]
        if not self.is_tail:
            return StepOutput(hidden=out.reshape((x.shape[0], *self.config.hidden_shape)))
        if item.rows:
            return StepOutput(rows=((out @ self._unembed) + self._mask).astype(np.float32))
        if not item.sample:
            return StepOutput()
        s.last_logits = (out[-1] @ self._unembed).astype(np.float64) + self._mask
        picked = self._pick(s, s.last_logits)
        if item.top_k:
            picked.top = TopLogits.of(s.last_logits, item.top_k)
        return picked

    def _pick(self, s: _Session, logits: npt.NDArray[np.float64]) -> StepOutput:
        token = self._sample(s, logits)
        n_top = s.sampling.logprobs
        if n_top is None:
            return StepOutput(token=token)
        lp = logits - logits.max()
        lp = lp - np.log(np.exp(lp).sum())
        top = [LogprobCandidate(token=int(t), logprob=float(lp[t]))
               for t in np.lexsort((np.arange(VOCAB), -lp))[:n_top]]
        return StepOutput(token=token, logprobs=TokenLogprobs(token=token, logprob=float(lp[token]), top=top))

    def _sample(self, s: _Session, logits: npt.NDArray[np.float64]) -> int:
        p = s.sampling
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        # A seeded draw depends on the seed and the position only, so a session rebuilt elsewhere (a repaired
        # tail) draws exactly what the original would have.
        rng = s.rng if s.seed is None else np.random.default_rng([s.seed & 0xFFFF_FFFF_FFFF_FFFF, s.position])
        assert rng is not None
        # Shifted before scaling: a tiny temperature then sends the others to -inf, never the best to +inf (NaN).
        probs = np.exp((logits - logits.max()) / p.temperature)  # exp(-inf) = 0 keeps masked tokens out
        probs /= probs.sum()
        if p.top_k:
            cutoff = np.sort(probs)[-min(p.top_k, VOCAB)]
            probs = np.where(probs >= cutoff, probs, 0.0)
            probs /= probs.sum()
        return int(rng.choice(VOCAB, p=probs))

    def last_logits(self, session_id: str) -> npt.NDArray[np.float64]:
        """The logits the session's last sample was drawn from (tests compare logprobs against them)."""
        logits = self._sessions[session_id].last_logits
        if logits is None:
            raise BadRequestError(f"session {session_id} has sampled nothing")
        return logits.copy()

    def positions_computed(self, session_id: str) -> int:
        return self._sessions[session_id].positions_computed

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if 0 <= token < 256 else b""

    def is_end_of_generation(self, token: int) -> bool:
        return token == EOS

    def close_session(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id)
            if session is not None:
                self.closed_positions[session_id] = session.positions_computed

    def kv_bytes_in_use(self) -> int:
        return sum(len(s.sums) * self._dim * 4 for s in self._sessions.values())

    # ---- KV in and out (``actors.backend.KvBackend``) ------------------------------------------------------------

    def export_kv(self, session_id: str, start: int, end: int) -> bytes:
        with self._lock:
            s = self._sessions.exporting(session_id, start, end)
            rows = np.stack([np.stack(s.sums[il][start:end]) for il in range(self._layers.start, self._layers.end)])
            head = _KV_HEAD.pack(_KV_MAGIC, self._layers.start, self._layers.end, start, end, self._dim)
            return head + rows.astype("<f4").tobytes()

    def import_kv(self, session_id: str, blobs: list[bytes], end: int) -> None:
        with self._lock:
            s = self._sessions[session_id]
            at, parts = s.position, []
            for blob in blobs:
                magic, first, last, start, stop, dim = _KV_HEAD.unpack_from(blob) if len(blob) >= _KV_HEAD.size \
                    else (b"", 0, 0, 0, 0, 0)
                if magic != _KV_MAGIC or (first, last, dim) != (self._layers.start, self._layers.end, self._dim):
                    raise SnapshotError(f"not a KV blob of layers {self._layers} of this stub model")
                if start != at or len(blob) != _KV_HEAD.size + 4 * len(self._layers) * (stop - start) * dim:
                    raise SnapshotError(f"KV blob of positions [{start}, {stop}) does not continue at {at}")
                parts.append(np.frombuffer(blob, "<f4", offset=_KV_HEAD.size).reshape(len(self._layers),
                                                                                       stop - start, dim))
                at = stop
            if at != end:
                raise SnapshotError(f"the KV blobs end at position {at}, not {end}")
            for part in parts:
                for i, il in enumerate(range(self._layers.start, self._layers.end)):
                    s.sums.setdefault(il, []).extend(row.copy() for row in part[i])
            s.position = end

    def truncate(self, session_id: str, position: int) -> None:
        with self._lock:
            s = self._sessions.truncating(session_id, position)
            for history in s.sums.values():
                del history[position:]
            s.position = position

    def kv_continues(self, session_id: str) -> bool:
        with self._lock:
            s = self._sessions[session_id]
            return all(len(history) == s.position for history in s.sums.values())

    def replay_sampled(self, session_id: str, tokens: list[int]) -> None:
        """Nothing to replay: the stub's draws depend only on the seed and the position (``_sample``)."""
        self._sessions[session_id]  # refuses a session not open

    def close(self) -> None:
        self._sessions.clear()
