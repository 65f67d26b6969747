"""The tail's view of one generation: UTF-8-safe incremental detokenization, stop strings and finish reasons.

Text is released only when it is complete UTF-8 and cannot be the start of a stop string, so a client never sees a
split character or the first half of a stop sequence that later matches.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from schemas.session import FinishReason


class StopMatcher:
    """Holds back any suffix of the text that could still grow into a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        self._held += text
        if not self._stops:
            out, self._held = self._held, ""
            return out, False
        hits = [i for i in (self._held.find(s) for s in self._stops) if i >= 0]
        if hits:
            out, self._held = self._held[: min(hits)], ""
            return out, True
        keep = self._longest_partial()
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out, False

    def _longest_partial(self) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._held)), best, -1):
                if self._held.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


class Generation:
    """Counts tokens against max_tokens, turns token bytes into text, and decides when and why generation ends."""

    def __init__(self, *, max_tokens: int, stops: list[str], ignore_eos: bool,
                 token_bytes: Callable[[int], bytes], is_eog: Callable[[int], bool],
                 context_length: int | None = None) -> None:
        self.max_tokens = max_tokens
        self.context_length = context_length
        """Positions the session may hold; generation ends before a step would pass it."""
        self.ignore_eos = ignore_eos
        self.count = 0
        self.finish_reason: FinishReason | None = None
        self._token_bytes = token_bytes
        self._is_eog = is_eog
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(stops)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def ends_for_certain(self, token: int, count: int, *, position: int) -> bool:
        """Whether the ``count``-th generated token, leaving the session at ``position`` positions, ends the
        generation whatever its text: end of generation, ``max_tokens``, or a context with no room for the step
        that would feed it. Pure, so the engine's thread may ask it (stop strings need the text: ``accept``)."""
        return (count >= self.max_tokens
                or (self.context_length is not None and position > self.context_length)
                or (not self.ignore_eos and self._is_eog(token)))

    def accept(self, token: int) -> tuple[str, FinishReason | None]:
        """Record one sampled token; returns the text it releases and the finish reason if generation ends."""
        if self.done:
            raise RuntimeError("generation already finished")
        self.count += 1
        if self._is_eog(token) and not self.ignore_eos:
            self.finish_reason = "stop"
            return self._drain(), "stop"
        text, stopped = self._stops.feed(self._utf8.decode(self._token_bytes(token)))
        if stopped:
            self.finish_reason = "stop"
        elif self.count >= self.max_tokens:
            self.finish_reason = "length"
            text += self._drain()
        return text, self.finish_reason

    def _drain(self) -> str:
        """Everything still held, in stream order: text kept back for a possible stop, then an incomplete character."""
        tail, _ = self._stops.feed(self._utf8.decode(b"", final=True))
        return tail + self._stops.flush()
