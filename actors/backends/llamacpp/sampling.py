"""A session's sampler: a llama.cpp sampler chain built from ``SamplingParams``, an optional grammar, and logprobs.

The chain follows llama.cpp's own order (common/sampling.cpp): penalties, top-k, top-p, min-p, temperature, then
the seeded random pick; temperature 0 is the greedy sampler, the same one llama-cpp-python uses for ``temp=0``.
The penalty sampler keeps its own window of recent tokens: the prompt is fed to it up front (as llama.cpp's
server does), and every sampled token is accepted into it.

A grammar (``SamplingParams.constraint``, see ``grammar.py``) is kept out of the chain and applied the way
llama.cpp's ``common_sampler`` does: sample without it, check only the picked token against it, and only when the
grammar rejects that token apply it to the candidates and sample again. Checking one token costs microseconds;
applying a grammar to this 262k-token vocabulary costs tens of milliseconds. Two exact shortcuts avoid most of
those: greedy's constrained pick is the best-scoring token the grammar accepts, so the grammar is applied to the 64
(then 4096) best tokens first; plain temperature sampling (no top-k/top-p/min-p, no penalties, the OpenAI default)
draws by rejection with its own seeded numpy generator (``Sampler._draw_constrained``), so its tokens for a given
seed are not llama.cpp's ``dist`` sampler's, but the distribution is the same.

Logprobs (``SamplingParams.logprobs``) come from the raw logits row (log-softmax over the vocabulary, before
penalties, temperature and grammar), as llama-cpp-python's ``logprobs`` and vLLM's default do, and are computed
only when asked for.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from actors.backends.llamacpp.grammar import Grammar, grammar_for, param_of
from schemas.errors import BackendError, BadRequestError
from schemas.session import LogprobCandidate, SamplingParams, TokenLogprobs

_MIN_KEEP = 1
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)
_GREEDY_SHORTLISTS = (64, 4096)
"""Greedy under a grammar: shortlist sizes tried before the whole vocabulary."""
_MAX_DRAWS = 64
"""Hot sampling under a grammar: draws checked one by one before the grammar is applied to the vocabulary."""
_TOP_WINDOW = 10.0
"""Top-N logprobs look among logits within this many nats of the maximum first (a few hundred tokens at most on a
real distribution), and fall back to partitioning the whole row when fewer than N are there."""

assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


def _equal_candidates(smpl: Any, n: int) -> int:
    """Apply ``smpl`` to ``n`` equally likely candidates; the index it selected."""
    data = (llama_cpp.llama_token_data * n)(*(llama_cpp.llama_token_data(i, 0.0, 0.0) for i in range(n)))
    arr = llama_cpp.llama_token_data_array(data, n, -1, False)
    llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
    return int(arr.selected)


def _dist_draws_on_one() -> bool:
    """Whether llama.cpp's ``dist`` sampler draws a random number when one candidate is left. It did not in older
    releases; since backend sampling it does, to keep its state aligned. Asked of the library loaded rather than
    assumed: a sampler rebuilt by replaying tokens must draw exactly as often as the one it replaces (issue #31: a
    seeded session lost sync after a repair, a few tokens in, wherever top-p had left one candidate)."""
    probed, fresh = llama_cpp.llama_sampler_init_dist(1), llama_cpp.llama_sampler_init_dist(1)
    try:
        _equal_candidates(probed, 1)
        after = [_equal_candidates(probed, 1024) for _ in range(4)]
        return after != [_equal_candidates(fresh, 1024) for _ in range(4)]
    finally:
        llama_cpp.llama_sampler_free(probed)
        llama_cpp.llama_sampler_free(fresh)


_DIST_DRAWS_ON_ONE = _dist_draws_on_one()


def _has_penalties(p: SamplingParams) -> bool:
    return p.penalty_last_n != 0 and (p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0
                                      or p.presence_penalty != 0.0)


def _stages(p: SamplingParams, n_vocab: int, seed: int | None) -> list[Any]:
    stages: list[Any] = []
    if _has_penalties(p):
        stages.append(llama_cpp.llama_sampler_init_penalties(n_vocab, p.penalty_last_n, p.repeat_penalty,
                                                             p.frequency_penalty, p.presence_penalty))
    if p.temperature == 0.0:
        stages.append(llama_cpp.llama_sampler_init_greedy())
        return stages
    if p.top_k > 0:
        stages.append(llama_cpp.llama_sampler_init_top_k(p.top_k))
    if p.top_p < 1.0:
        stages.append(llama_cpp.llama_sampler_init_top_p(p.top_p, _MIN_KEEP))
    if p.min_p > 0.0:
        stages.append(llama_cpp.llama_sampler_init_min_p(p.min_p, _MIN_KEEP))
    stages.append(llama_cpp.llama_sampler_init_temp(p.temperature))
    # No seed: llama.cpp draws one (LLAMA_DEFAULT_SEED means "random").
    stages.append(llama_cpp.llama_sampler_init_dist(llama_cpp.LLAMA_DEFAULT_SEED if seed is None
                                                    else seed & 0xFFFFFFFF))
    return stages


def token_logprobs(logits: npt.NDArray[np.float32], token: int, n_top: int) -> TokenLogprobs:
    """log-softmax of ``logits`` at ``token``, and the ``n_top`` most likely tokens (most likely first; equal
    logprobs in id order). float32 throughout, like llama-cpp-python's ``Llama.logits_to_logprobs``."""
    peak = logits.max()
    shifted = logits - peak
    log_total = np.log(np.exp(shifted).sum(dtype=np.float32))
    top: list[LogprobCandidate] = []
    if n_top:
        near = np.flatnonzero(shifted >= -_TOP_WINDOW)
        if len(near) < n_top:
            near = np.argpartition(logits, -n_top)[-n_top:]
        elif len(near) > 4 * n_top:
            near = near[np.argpartition(logits[near], -n_top)[-n_top:]]
        best = near[np.lexsort((near, -logits[near]))][:n_top]
        # model_construct: fields computed here, and a validated model costs tens of microseconds per token.
        top = [LogprobCandidate.model_construct(token=int(t), logprob=float(shifted[t] - log_total)) for t in best]
    return TokenLogprobs.model_construct(token=token, logprob=float(shifted[token] - log_total), top=top)


class Sampler:
    """One session's chain, grammar and logprobs. Not thread-safe: used from the backend's decode thread only.

    ``seed`` overrides ``params.seed`` (a fork of an n > 1 session samples with ``seed + i``)."""

    def __init__(self, params: SamplingParams, *, n_vocab: int, prompt_tokens: Sequence[int] = (),
                 vocab: Any = None, seed: int | None = None) -> None:
        self.params = params
        self._n_vocab = n_vocab
        self._seed = params.seed if seed is None else seed
        self._grammar: Any = None
        self._chain: Any = None
        self._scratch: npt.NDArray[np.void] | None = None
        self._greedy = params.temperature == 0.0
        # Plain temperature sampling (no truncation, no penalties) under a grammar draws in numpy with its own seeded
        # generator: see _draw_constrained. Every other hot configuration keeps llama.cpp's chain.
        plain_hot = (not self._greedy and not _has_penalties(params) and params.top_k == 0 and params.top_p == 1.0
                     and params.min_p == 0.0)
        self._keyed = plain_hot and params.constraint is not None
        """Draws in numpy from a generator keyed by (seed, token number): its state is the token count."""
        self._rng: np.random.Generator | None = None
        self.tokens = 0
        """Tokens sampled or replayed so far: with ``seed``, the sampler's random state."""
        # Plain greedy needs no chain state: numpy's argmax picks the first maximum exactly as llama.cpp's greedy
        # sampler does, ~10x faster than building llama.cpp's 262k-entry candidate array every step.
        self._argmax = self._greedy and not _has_penalties(params)
        self._chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not self._chain:
            raise BackendError("llama.cpp could not create a sampler chain")
        for stage in _stages(params, n_vocab, self._seed):
            # The chain owns (and frees) every stage added to it.
            llama_cpp.llama_sampler_chain_add(self._chain, stage)
        hot = not self._greedy and not self._keyed
        self._dist: Any = (llama_cpp.llama_sampler_chain_get(self._chain, llama_cpp.llama_sampler_chain_n(self._chain)
                                                             - 1) if hot else None)
        """The chain's seeded random pick (its last stage), advanced by hand where it would not draw."""
        self.seed: int | None = None
        """The seed the random picks use (drawn by llama.cpp when the session gave none); None: greedy."""
        if hot:
            self.seed = int(llama_cpp.llama_sampler_get_seed(self._chain))
        elif self._keyed:
            self.seed = (self._seed if self._seed is not None
                         else int(np.random.SeedSequence().generate_state(1, np.uint64)[0])) & 0xFFFF_FFFF_FFFF_FFFF
        self.draws_per_token = 0 if not hot else 2 if params.constraint is not None else 1
        self._drawn = 0
        """Draws of the token being sampled (topped up to ``draws_per_token``)."""
        if params.constraint is not None:
            if vocab is None:
                self.close()
                raise BackendError("a grammar needs the model's vocabulary")
            self._grammar = _grammar_sampler(vocab, grammar_for(params.constraint, params.reasoning),
                                             param_of(params.constraint))
        if _has_penalties(params):
            window = prompt_tokens[-params.penalty_last_n:]
            for token in window:
                llama_cpp.llama_sampler_accept(self._chain, token)

    @property
    def constrained(self) -> bool:
        return self._grammar is not None

    def sample(self, ctx: Any, row: int) -> tuple[int, TokenLogprobs | None]:
        """Sample from the logits of batch row ``row`` of the last decode and remember the pick (penalties,
        grammar). Returns the token and, when the session asked for them, its logprobs."""
        if self._chain is None:
            raise BackendError("sampler used after close()")
        ptr = llama_cpp.llama_get_logits_ith(ctx, row)
        if not ptr:
            raise BackendError(f"no logits for batch row {row}")
        return self.pick(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)))

    def pick(self, logits: npt.NDArray[np.float32]) -> tuple[int, TokenLogprobs | None]:
        """``sample`` from a logits row already in hand."""
        if self._chain is None:
            raise BackendError("sampler used after close()")
        if self._grammar is not None:
            token = self._sample_constrained(logits)
        elif self._argmax:
            token = int(logits.argmax())
        elif self._dist is None:
            token = self._apply(self._chain, logits)
            llama_cpp.llama_sampler_accept(self._chain, token)
        else:
            # As llama_sampler_sample (build the candidates, apply the chain, accept), with the draws counted.
            token = self._apply(self._chain, logits)
            llama_cpp.llama_sampler_accept(self._chain, token)
        self._token_done()
        lp = None if self.params.logprobs is None else token_logprobs(logits, token, self.params.logprobs)
        return token, lp

    def accept(self, token: int) -> None:
        """Remember ``token`` as if this sampler had picked it (penalty window, grammar state, random state): a
        sampler rebuilt for a session that already generated tokens (a repaired tail) replays them, and then draws
        what the sampler it replaces would have drawn next (built with its ``seed``)."""
        if self._chain is None:
            raise BackendError("sampler used after close()")
        if self._grammar is not None:
            llama_cpp.llama_sampler_accept(self._grammar, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        self._token_done()

    def _token_done(self) -> None:
        """One token sampled (or replayed): the random pick has drawn exactly ``draws_per_token`` times."""
        if self._dist is not None:
            for _ in range(self.draws_per_token - self._drawn):
                self._advance()
        self._drawn = 0
        self.tokens += 1

    def _advance(self) -> None:
        """One draw of the chain's random pick, on two equal candidates (with one, some releases do not draw)."""
        _equal_candidates(self._dist, 2)

    def _keyed_rng(self) -> np.random.Generator:
        """The generator of the token being sampled: keyed by (seed, token number), so its state is the count."""
        assert self.seed is not None
        return np.random.default_rng([self.seed, self.tokens])

    # --- grammar ------------------------------------------------------------------------------------------------

    def _sample_constrained(self, logits: npt.NDArray[np.float32]) -> int:
        if self._argmax:
            token = int(logits.argmax())
            if not self._allows(token, logits):
                token = self._greedy_constrained(logits)
        elif self._keyed:
            self._rng = self._keyed_rng()
            token = self._draw_constrained(logits)
        else:
            token = self._apply(self._chain, logits)
            if not self._allows(token, logits):
                # As llama.cpp's common_sampler: constrain, then sample again with the whole chain.
                self._apply(self._grammar, logits, select=False)
                token = self._apply(self._chain, None)
        llama_cpp.llama_sampler_accept(self._grammar, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def _draw_constrained(self, logits: npt.NDArray[np.float32]) -> int:
        """softmax(logits / temperature) restricted to what the grammar allows, by rejection: draw from the whole
        distribution and keep the first draw the grammar accepts, which is distributed exactly as the restricted
        distribution. A check costs microseconds where applying the grammar to the vocabulary costs tens of
        milliseconds; after ``_MAX_DRAWS`` rejections (the model wants what the grammar forbids) the grammar is
        applied after all and the draw made among the allowed tokens."""
        assert self._rng is not None
        z = logits.astype(np.float64) / self.params.temperature
        weights = np.exp(z - z.max())
        cdf = np.cumsum(weights)
        draws = np.searchsorted(cdf, self._rng.random(_MAX_DRAWS) * cdf[-1], side="right")
        for token in np.minimum(draws, self._n_vocab - 1).tolist():
            if self._allows(token, logits):
                return int(token)
        self._apply(self._grammar, logits, select=False)
        assert self._scratch is not None
        allowed = np.isfinite(self._scratch["logit"])
        if not allowed.any():
            raise BackendError("the grammar allows no token here")
        ids = self._scratch["id"][allowed]
        cdf = np.cumsum(weights[ids])
        return int(ids[min(int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right")), len(ids) - 1)])

    def _allows(self, token: int, logits: npt.NDArray[np.float32]) -> bool:
        one = llama_cpp.llama_token_data(token, float(logits[token]), 0.0)
        arr = llama_cpp.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        return math.isfinite(one.logit)

    def _greedy_constrained(self, logits: npt.NDArray[np.float32]) -> int:
        for size in (*_GREEDY_SHORTLISTS, self._n_vocab):
            if size >= self._n_vocab:
                ids = np.arange(self._n_vocab, dtype=np.int32)
            else:
                ids = np.argpartition(logits, -size)[-size:].astype(np.int32)
            data = self._fill(ids, logits[ids])
            self._apply_array(self._grammar, data)
            allowed = np.isfinite(data["logit"])
            if allowed.any():
                # The best allowed token; among equals the lowest id, as argmax and llama.cpp's greedy pick.
                cand = data[allowed]
                best = cand["logit"].max()
                return int(cand["id"][cand["logit"] == best].min())
        raise BackendError("the grammar allows no token here")

    def _fill(self, ids: npt.NDArray[np.int32], values: npt.NDArray[np.float32]) -> npt.NDArray[np.void]:
        if self._scratch is None:
            self._scratch = np.zeros(self._n_vocab, dtype=_TOKEN_DATA)
        data = self._scratch[:len(ids)]
        data["id"] = ids
        data["logit"] = values
        data["p"] = 0.0
        return data

    def _apply_array(self, smpl: Any, data: npt.NDArray[np.void]) -> int:
        arr = llama_cpp.llama_token_data_array(
            data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), len(data), -1, False)
        llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
        return int(arr.selected)

    def _apply(self, smpl: Any, logits: npt.NDArray[np.float32] | None, *, select: bool = True) -> int:
        """Run ``smpl`` over the whole vocabulary (``logits``), or over the candidates a previous call left in the
        scratch array (``None``); returns the selected token."""
        if logits is not None:
            data = self._fill(np.arange(self._n_vocab, dtype=np.int32), logits)
        else:
            assert self._scratch is not None
            data = self._scratch
        arr = llama_cpp.llama_token_data_array(
            data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), len(data), -1, False)
        llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
        if not select:
            return -1
        if smpl is self._chain and self._dist is not None and (arr.size >= 2 or _DIST_DRAWS_ON_ONE):
            self._drawn += 1
        if not 0 <= arr.selected < arr.size:
            raise BackendError("the sampler chain selected no token")
        # Samplers sort and truncate in place: the array's data pointer is still the scratch buffer.
        picked = ctypes.cast(arr.data, ctypes.POINTER(llama_cpp.llama_token_data))[arr.selected]
        return int(picked.id)

    def close(self) -> None:
        """Free the chain and the grammar. Idempotent."""
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None


def _grammar_sampler(vocab: Any, grammar: Grammar, param: str) -> Any:
    text, root = grammar.text.encode(), grammar.root.encode()
    if grammar.triggers:
        patterns = (ctypes.c_char_p * len(grammar.triggers))(*(t.encode() for t in grammar.triggers))
        smpl = llama_cpp.llama_sampler_init_grammar_lazy_patterns(vocab, text, root, patterns, len(patterns),
                                                                  None, 0)
    else:
        smpl = llama_cpp.llama_sampler_init_grammar(vocab, text, root)
    if not smpl:
        # llama.cpp logs the parse error and returns NULL.
        raise BadRequestError("llama.cpp could not parse the grammar for this constraint", param=param)
    return smpl
