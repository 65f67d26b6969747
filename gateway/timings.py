"""llama.cpp-style ``timings`` (issue #26): llama-server's per-request figures, beside the ``swarmroute`` telemetry.

The figures are what the route measured, as its head reports them in Generation Telemetry: the prompt's reused
positions (``prefill.reused``: ``cache_n``; the rest were computed: ``prompt_n``), the prefill's wall time (the head's
time to its first token: llama-server's prompt time also ends with the first token sampled), the decode time from the
first token to the latest (``elapsed_ms`` at that snapshot less the prefill), and the verify windows' drafts. A
whole reply, and a stream's last chunk, carry the final figures (the head's complete snapshot arrives before its
end). With ``timings_per_token`` every chunk carries the figures so far: decode time is then measured where the
stream is relayed, from the first token's arrival at the gateway to this one's, since telemetry snapshots are
rate-limited and a token's own arrives later than it.
"""

from __future__ import annotations

import time

from schemas.openai import Timings
from schemas.telemetry import GenerationTelemetry


def timings(prompt_tokens: int, predicted_n: int, telemetry: GenerationTelemetry | None, *,
            predicted_ms: float | None = None) -> Timings:
    """The figures for a prompt of ``prompt_tokens`` and ``predicted_n`` tokens generated so far; ``predicted_ms``
    overrides the telemetry's decode time (a stream's running figures)."""
    cache_n = min(telemetry.prefill.reused, prompt_tokens) if telemetry is not None else 0
    prompt_n = prompt_tokens - cache_n
    prompt_ms = telemetry.ttft_ms if telemetry is not None and telemetry.ttft_ms is not None else 0.0
    if predicted_ms is None:
        predicted_ms = max(0.0, telemetry.elapsed_ms - prompt_ms) if telemetry is not None and prompt_ms else 0.0
    steps = max(0, predicted_n - 1)  # the first token comes from the prefill's last logits
    spec = telemetry.speculation if telemetry is not None else None
    drafted = spec is not None and spec.drafts_offered > 0
    return Timings(
        cache_n=cache_n, prompt_n=prompt_n, prompt_ms=round(prompt_ms, 3),
        prompt_per_token_ms=round(prompt_ms / prompt_n, 3) if prompt_n and prompt_ms else 0.0,
        prompt_per_second=round(1e3 * prompt_n / prompt_ms, 3) if prompt_ms else 0.0,
        predicted_n=predicted_n, predicted_ms=round(predicted_ms, 3),
        predicted_per_token_ms=round(predicted_ms / steps, 3) if steps and predicted_ms else 0.0,
        predicted_per_second=round(1e3 * steps / predicted_ms, 3) if predicted_ms else 0.0,
        draft_n=spec.drafts_offered if drafted and spec is not None else None,
        draft_n_accepted=spec.drafts_accepted if drafted and spec is not None else None)


class TimingsClock:
    """A stream's running figures: tokens relayed so far and the time since the first one arrived."""

    def __init__(self) -> None:
        self.tokens = 0
        self._first: float | None = None
        self._last = 0.0

    def token(self) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
        self.tokens += 1
        self._last = now

    def running(self, prompt_tokens: int, telemetry: GenerationTelemetry | None) -> Timings:
        decode_ms = (self._last - self._first) * 1e3 if self._first is not None else 0.0
        return timings(prompt_tokens, self.tokens, telemetry, predicted_ms=decode_ms)
