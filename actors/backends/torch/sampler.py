"""Token sampling on the tail, per session, in llama.cpp's order: penalties, top-k, top-p, min-p, temperature.

Temperature 0 is greedy: exactly ``argmax`` of the (penalized) logits, as ``generate(do_sample=False)`` does.
Otherwise the ``k``-th token of a session's stream is drawn from a generator seeded with ``(seed, k)`` alone, the
seed being ``SamplingParams.seed`` (or one the OS picked at open). A seeded request is reproducible whatever else
the node is serving, and a sampler started over and told the tokens so far (``accept``, issue #18's
``replay_sampled`` on a repaired or rebuilt tail) draws exactly what the original would have, as the stub does.
"""

from __future__ import annotations

import collections
import hashlib
import secrets
import struct

import torch

from schemas.session import LogprobCandidate, SamplingParams, TokenLogprobs


class TorchSampler:
    """``seed`` overrides ``params.seed`` (choice ``i`` of an n > 1 session samples with ``seed + i``)."""

    def __init__(self, params: SamplingParams, prompt_tokens: list[int], seed: int | None = None) -> None:
        self.params = params
        self.seed = seed if seed is not None else params.seed if params.seed is not None else secrets.randbits(63)
        """The stream's seed (kept so that a sampler started over draws as this one does)."""
        self.generated = 0
        """Tokens of the stream so far, sampled or accepted: the index of the next draw."""
        self._generator = torch.Generator()
        # Penalties see the prompt too, as in llama.cpp; only the last ``penalty_last_n`` tokens matter.
        self._recent: collections.deque[int] = collections.deque(prompt_tokens, maxlen=max(params.penalty_last_n, 1))

    def sample(self, logits: torch.Tensor) -> int:
        """Pick a token from float32 ``logits`` of shape ``(vocab,)`` and remember it for the penalties."""
        logits = self._penalize(logits)
        token = int(torch.argmax(logits)) if self.params.temperature == 0.0 else self._draw(logits)
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        """Count ``token`` as the stream's next one, as if this sampler had drawn it (penalty window, draw index)."""
        self._recent.append(token)
        self.generated += 1

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        neutral = p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
        if neutral or p.penalty_last_n == 0 or not self._recent:
            return logits
        counts = collections.Counter(self._recent)
        ids = torch.tensor(list(counts), dtype=torch.long)
        ids = ids[ids < logits.shape[0]]
        if ids.numel() == 0:
            return logits
        freq = torch.tensor([counts[int(i)] for i in ids], dtype=logits.dtype)
        out = logits.clone()
        picked = out[ids]
        picked = torch.where(picked > 0, picked / p.repeat_penalty, picked * p.repeat_penalty)
        out[ids] = picked - freq * p.frequency_penalty - p.presence_penalty
        return out

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        candidates = torch.arange(logits.shape[0])
        if p.top_k and p.top_k < logits.shape[0]:
            logits, keep = torch.topk(logits, p.top_k)
            candidates = candidates[keep]
        if p.top_p < 1.0:
            order = torch.argsort(logits, descending=True)
            probs = torch.softmax(logits[order], dim=-1)
            # Smallest prefix whose mass reaches top_p (at least one token).
            n_keep = int(torch.searchsorted(torch.cumsum(probs, dim=-1), torch.tensor(p.top_p)).item()) + 1
            keep = order[: min(n_keep, order.numel())]
            logits, candidates = logits[keep], candidates[keep]
        if p.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            keep = probs >= p.min_p * probs.max()
            logits, candidates = logits[keep], candidates[keep]
        probs = torch.softmax(logits / p.temperature, dim=-1)
        choice = torch.multinomial(probs, 1, generator=self._generator.manual_seed(_draw_seed(self.seed,
                                                                                               self.generated)))
        return int(candidates[choice])


def _draw_seed(seed: int, index: int) -> int:
    """The generator seed of draw ``index`` of stream ``seed``. Hashed, not added: choice ``i`` of an n > 1 request
    streams with ``seed + i``, and ``seed + index`` would make its draws those of choice ``i + 1`` one step later."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed & 0xFFFF_FFFF_FFFF_FFFF, index), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes a non-negative int64


def token_logprobs(logits: torch.Tensor, token: int, n_top: int) -> TokenLogprobs:
    """log-softmax of the raw ``logits`` at ``token`` and the ``n_top`` most likely tokens (as the llama.cpp
    backend reports them: before penalties and temperature; equal logprobs in id order)."""
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    top: list[LogprobCandidate] = []
    if n_top:
        values, ids = torch.topk(lp, min(n_top, lp.shape[0]))
        pairs = sorted(zip(values.tolist(), ids.tolist(), strict=True), key=lambda vi: (-vi[0], vi[1]))
        top = [LogprobCandidate(token=int(i), logprob=float(v)) for v, i in pairs]
    return TokenLogprobs(token=token, logprob=float(lp[token]), top=top)
