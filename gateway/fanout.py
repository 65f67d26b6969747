"""Greedy choices are one sequence: at temperature 0 the gateway asks the route for a single choice and gives its
tokens to every one of the request's ``n`` choices.

Greedy decoding (with any penalties or grammar: both deterministic) picks the same tokens for every choice by
definition, yet n sequences decoded batched on a hop do not compute quite the same logits (ggml's CPU kernels are
not batch-invariant, docs/llamacpp-backend.md), so forked greedy choices drifted apart at near-ties. One sequence
fanned out is identical by construction, is exactly the ``n = 1`` reply (same batch shape), and saves n - 1
sequences and their forward-pass rows on every hop. Sampled choices (temperature > 0) still fork on the route.
"""

from __future__ import annotations

from schemas.session import ChoiceEnd, SamplingParams, SessionEnd, TokenEvent


def route_choices(n: int, sampling: SamplingParams) -> int:
    """How many choices the route decodes for a request of ``n``: one when greedy, else ``n``."""
    return 1 if sampling.temperature == 0.0 else n


def fan_token(event: TokenEvent, n: int) -> list[TokenEvent]:
    """The route's token of its one choice as the token of each of ``n`` choices (same text, logprobs, finish)."""
    return [event, *(event.model_copy(update={"index": i}) for i in range(1, n))]


def fan_end(end: SessionEnd, n: int) -> SessionEnd:
    """The route's end of its one choice as the end of ``n`` equal choices: each ends as it did, and
    ``completion_tokens`` counts every choice (what ``usage`` reports, as for forked choices)."""
    return end.model_copy(update={
        "completion_tokens": end.completion_tokens * n,
        "choices": [ChoiceEnd(index=i, finish_reason=end.finish_reason, completion_tokens=end.completion_tokens)
                    for i in range(n)]})
