"""A session's sampler: a llama.cpp sampler chain built from ``SamplingParams``.

The chain follows llama.cpp's own order (common/sampling.cpp): penalties, top-k, top-p, min-p, temperature, then
the seeded random pick; temperature 0 is the greedy sampler, the same one llama-cpp-python uses for ``temp=0``.
The penalty sampler keeps its own window of recent tokens: the prompt is fed to it up front (as llama.cpp's
server does), and ``llama_sampler_sample`` feeds it every sampled token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np

from schemas.errors import BackendError
from schemas.session import SamplingParams

_MIN_KEEP = 1


def _has_penalties(p: SamplingParams) -> bool:
    return p.penalty_last_n != 0 and (p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0
                                      or p.presence_penalty != 0.0)


def _stages(p: SamplingParams, n_vocab: int) -> list[Any]:
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
    seed = llama_cpp.LLAMA_DEFAULT_SEED if p.seed is None else p.seed & 0xFFFFFFFF
    stages.append(llama_cpp.llama_sampler_init_dist(seed))
    return stages


class Sampler:
    """One session's chain. Not thread-safe: used from the backend's decode thread only."""

    def __init__(self, params: SamplingParams, *, n_vocab: int, prompt_tokens: Sequence[int] = ()) -> None:
        self.params = params
        self._n_vocab = n_vocab
        # Plain greedy needs no chain state: numpy's argmax picks the first maximum exactly as llama.cpp's greedy
        # sampler does, ~10x faster than building llama.cpp's 262k-entry candidate array every step.
        self._argmax = params.temperature == 0.0 and not _has_penalties(params)
        self._chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not self._chain:
            raise BackendError("llama.cpp could not create a sampler chain")
        for stage in _stages(params, n_vocab):
            # The chain owns (and frees) every stage added to it.
            llama_cpp.llama_sampler_chain_add(self._chain, stage)
        if _has_penalties(params):
            window = prompt_tokens[-params.penalty_last_n:]
            for token in window:
                llama_cpp.llama_sampler_accept(self._chain, token)

    def sample(self, ctx: Any, row: int) -> int:
        """Sample from the logits of batch row ``row`` of the last decode, and remember the pick for penalties."""
        if self._chain is None:
            raise BackendError("sampler used after close()")
        if self._argmax:
            logits = llama_cpp.llama_get_logits_ith(ctx, row)
            if not logits:
                raise BackendError(f"no logits for batch row {row}")
            return int(np.ctypeslib.as_array(logits, shape=(self._n_vocab,)).argmax())
        return int(llama_cpp.llama_sampler_sample(self._chain, ctx, row))

    def close(self) -> None:
        """Free the chain. Idempotent."""
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
