"""Speculative decoding across a route (issue #20): how the tail accepts a window of draft tokens, and how long the
head's windows should be. Pure: no I/O, no clock, no backend.

A verify window feeds ``[t, d1, ..., dk]`` at positions ``p .. p+k``: ``t`` is the last token the route sampled,
``d1..dk`` the head's drafts. Row ``i`` of the tail's logits is the model's distribution after input ``i``, so it
judges draft ``d_{i+1}``; row ``k`` gives one more token after the last draft.

* Greedy: the longest prefix of drafts that equal the row's argmax is accepted, then the argmax of the next row:
  exactly the tokens plain greedy decoding gives.
* Sampling (the standard rule of Leviathan et al. / Chen et al., 2023): draft ``d`` proposed with probability
  ``q(d)`` is accepted with probability ``min(1, p(d) / q(d))``; the first rejected one is replaced by a draw from
  ``norm(max(0, p - q))``; after ``k`` acceptances a last token is drawn from ``p``. Every emitted token is then
  distributed exactly as plain sampling from ``p`` would be. Drafts from n-gram lookup are point masses
  (``q(d) = 1``): accept with ``p(d)``, on rejection draw from ``p`` without ``d``.

Every uniform a draw uses comes from the session's seed and the draw's position alone (``draws``), so a seeded
window gives the same tokens wherever and however often it is verified.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

Probs = npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """How the tail turns a logits row into the distribution it samples from (no penalties, no grammar:
    speculation is only offered to sessions whose distribution is a function of the row alone)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: npt.NDArray[np.floating]) -> Probs:
        """softmax(logits / temperature), truncated as llama.cpp's top-k, top-p, min-p do, renormalized."""
        z = logits.astype(np.float64)
        z = (z - z.max()) / self.temperature
        p = np.exp(z)
        keep = np.ones(p.shape, dtype=bool)
        if self.top_k > 0 and self.top_k < p.size:
            keep &= p >= np.partition(p, -self.top_k)[-self.top_k]
        if self.min_p > 0.0:
            keep &= p >= self.min_p * p.max()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cumulative = np.cumsum(p[order]) / p.sum()
            cut = int(np.searchsorted(cumulative, self.top_p)) + 1
            mask = np.zeros(p.shape, dtype=bool)
            mask[order[:cut]] = True
            keep &= mask
        kept: Probs = np.where(keep, p, 0.0)
        normalized: Probs = kept / kept.sum()
        return normalized


def draws(seed: int | None, position: int) -> np.random.Generator:
    """The generator of the draws made at ``position``: a function of the seed and the position only."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed & 0xFFFF_FFFF_FFFF_FFFF, position])


def _pick(p: Probs, u: float) -> int:
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), p.size - 1))


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    tokens: list[int]
    """The tokens the window emits: the accepted drafts, then the route's own next one."""
    accepted: int
    """How many drafts were accepted (``len(tokens) - 1``)."""


def verify(rows: npt.NDArray[np.floating], drafts: Sequence[int], target: Target, *, start: int,
           seed: int | None, draft_dists: Sequence[Probs] | None = None) -> Verdict:
    """Judge ``drafts`` (``len(rows) - 1`` of them) against the tail's logits ``rows``; ``start`` is the position of
    the window's first input, so row ``i``'s draws are those of position ``start + i + 1``. ``draft_dists``: the
    distribution each draft was drawn from (omitted: point masses, as n-gram lookup proposes)."""
    k = len(drafts)
    if rows.shape[0] != k + 1:
        raise ValueError(f"{rows.shape[0]} logits rows for {k} drafts")
    tokens: list[int] = []
    for i in range(k + 1):
        if target.greedy:
            best = int(np.argmax(rows[i]))
            if i < k and drafts[i] == best:
                tokens.append(best)
                continue
            tokens.append(best)
            return Verdict(tokens, i)
        p = target.probs(rows[i])
        rng = draws(seed, start + i + 1)
        if i == k:
            tokens.append(_pick(p, rng.random()))
            return Verdict(tokens, k)
        d = int(drafts[i])
        q = None if draft_dists is None else np.asarray(draft_dists[i], dtype=np.float64)
        q_d = 1.0 if q is None else float(q[d])
        u_accept, u_draw = rng.random(), rng.random()
        if q_d > 0 and u_accept < min(1.0, p[d] / q_d):
            tokens.append(d)
            continue
        if q is None:  # a point mass at d: max(0, p - q) is p without d
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        tokens.append(_pick(residual if total > 0 else p, u_draw))
        return Verdict(tokens, i)
    raise AssertionError("unreachable")


# ---- how long the next window should be ----------------------------------------------------------------------

RECOVERY = 0.05
"""How far an estimate no longer measured moves back towards its prior per window (``WindowSizer.observe_guess``)."""


@dataclasses.dataclass
class WindowSizer:
    """Chooses the draft length from what this session measured: the acceptance rate of its drafts (a moving
    average), the time a window spends outside the forward passes (the ring: links and hops, ``ring_ms``) and the
    cost of one more position in a pass (``position_ms``). A window of ``k`` drafts emits ``(1 - a^(k+1)) / (1 - a)``
    tokens on average for acceptance rate ``a`` and costs ``ring_ms + base_ms + k * position_ms``; the sizer picks
    the ``k`` that emits the most tokens per millisecond, and 0 (plain decoding) when no ``k`` beats it. Until it
    has measured anything it tries ``start`` drafts.

    With speculation off, nothing more is measured, so text that turns repetitive later (a small model falling
    into a loop, a passage quoted further on) would never be found out: after ``probe_after`` windows without
    drafts the sizer offers ``probe_k`` again, and each probe that fails doubles the wait (up to ``probe_most``),
    so probing costs a draft position every so many windows at most where drafts never pay.

    It also gives the odds that a window in flight comes back whole with its last token guessed right (``odds``),
    from how often windows did (``whole``, ``guessed``): what a window started behind it is worth."""

    max_k: int = 8
    start: int = 4
    smoothing: float = 0.3
    probe_after: int = 8
    probe_k: int = 1
    probe_most: int = 256
    acceptance: float | None = None
    ring_ms: float | None = None
    base_ms: float | None = None
    position_ms: float = 0.0
    whole: float | None = None
    """How often a window's drafts are all accepted (a moving average over windows with drafts). Drafts come in runs
    (a passage being copied holds for many tokens, then fails), so this is far above ``acceptance ** k``."""
    guessed: float | None = None
    """How often the guess at a whole window's last token (the first input of the window behind it) came true."""
    drafts_offered: int = 0
    drafts_accepted: int = 0
    windows: int = 0
    """Windows that carried drafts."""
    _since_drafts: int = 0
    _probe_wait: int = 0

    def observe(self, *, offered: int, accepted: int, ring_ms: float | None = None,
                base_ms: float | None = None, position_ms: float | None = None) -> None:
        if offered > 0:
            if self._off():  # a probe
                self._probe_wait = self.probe_after if accepted else min(2 * self._wait(), self.probe_most)
            self.acceptance = _ema(self.acceptance, accepted / offered, self.smoothing)
            self.whole = _ema(self.whole, float(accepted == offered), self.smoothing)
            self.drafts_offered += offered
            self.drafts_accepted += accepted
            self.windows += 1
            self._since_drafts = 0
        else:
            self._since_drafts += 1
        self.ring_ms = _ema(self.ring_ms, ring_ms, self.smoothing)
        self.base_ms = _ema(self.base_ms, base_ms, self.smoothing)
        if position_ms is not None:
            self.position_ms = _ema(self.position_ms, position_ms, self.smoothing) or 0.0

    def observe_guess(self, right: bool | None) -> None:
        """A window came back whole: whether the window behind it in flight was built on its last token, or None if
        there was none behind it (then what a guess would be worth drifts back towards the acceptance rate, slowly,
        so that guesses that failed a while ago are tried again)."""
        if right is not None:
            self.guessed = _ema(self.guessed, float(right), self.smoothing)
        elif self.guessed is not None and self.acceptance is not None:
            self.guessed += RECOVERY * (self.acceptance - self.guessed)

    def odds(self, drafts: int) -> float:
        """The chance that a window of ``drafts`` in flight comes back whole and its last token as guessed, i.e. that
        a window started behind it will be good."""
        a = self.acceptance or 0.0
        if self.whole is None:
            return a ** (drafts + 1)
        return (self.whole if drafts else 1.0) * (a if self.guessed is None else self.guessed)

    def next_k(self, available: int) -> int:
        """Drafts for the next window, at most ``available`` (what the draft source can propose)."""
        limit = min(self.max_k, available)
        if limit <= 0:
            return 0
        if self.acceptance is None or self.ring_ms is None or self.base_ms is None:
            return min(self.start, limit)
        k = self._best(limit)
        if k == 0 and self._since_drafts >= self._wait():
            return min(self.probe_k, limit)
        return k

    def _best(self, limit: int) -> int:
        assert self.acceptance is not None and self.ring_ms is not None and self.base_ms is not None
        return best_k(self.acceptance, self.ring_ms + self.base_ms, self.position_ms, limit)

    def _off(self) -> bool:
        return self.acceptance is not None and self.ring_ms is not None and self.base_ms is not None \
            and self._best(self.max_k) == 0

    def _wait(self) -> int:
        return self._probe_wait or self.probe_after

    @property
    def mean_accepted(self) -> float:
        return self.drafts_accepted / self.windows if self.windows else 0.0


@dataclasses.dataclass
class CostModel:
    """What a window's forward passes cost the route, ``base_ms + n * position_ms`` for ``n`` positions, fitted by
    least squares over the last ``history`` windows. While every window measured had the same length, one more
    position is taken to cost ``prior`` of a whole pass (small batches cost little more than one row on a CPU)."""

    history: int = 32
    prior: float = 0.1
    _points: collections.deque[tuple[int, float]] = dataclasses.field(default_factory=collections.deque)

    def observe(self, positions: int, compute_ms: float) -> None:
        self._points.append((positions, compute_ms))
        while len(self._points) > self.history:
            self._points.popleft()

    def _fit(self) -> tuple[float, float] | None:
        if not self._points:
            return None
        xs = [float(n) for n, _ in self._points]
        ys = [ms for _, ms in self._points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var == 0:
            slope = self.prior * my / max(1.0, 1 + self.prior * (mx - 1))
        else:
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var)
        return max(0.0, my - slope * mx), slope

    @property
    def base_ms(self) -> float | None:
        fit = self._fit()
        return None if fit is None else fit[0] + fit[1]  # a window's first position is part of its base

    @property
    def position_ms(self) -> float | None:
        fit = self._fit()
        return None if fit is None else fit[1]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a window of ``k`` drafts emits on average when each draft is accepted with probability ``acceptance``
    (independently, until the first rejection), the route's own token included."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_k(acceptance: float, fixed_ms: float, position_ms: float, limit: int) -> int:
    """The ``k`` in ``0..limit`` that maximizes tokens per millisecond; 0 when speculation does not pay."""
    def rate(k: int) -> float:
        return expected_tokens(acceptance, k) / max(fixed_ms + k * position_ms, 1e-6)
    return max(range(limit + 1), key=lambda k: (rate(k), -k))


MIN_ODDS = 0.2
"""The least chance that a window in flight is accepted whole for the head to start another behind it, however
long the ring: below it, the head's passes of stale windows would mostly be wasted (on a node that serves other
sessions too, the time is theirs)."""


def worth_optimism(odds: float, *, ring_ms: float | None, head_ms: float | None) -> bool:
    """Whether to start a window behind one in flight that is accepted whole (and its last token guessed right)
    with probability ``odds``. If it is, the window reaches the tail a round trip earlier: the ring and the head's
    pass are saved (``ring_ms + head_ms``); if not, the tail drops it unread and the head's pass is lost
    (``head_ms``), the rest of the route having waited for the verdict anyway. Worth it when
    ``odds * (ring_ms + head_ms) >= (1 - odds) * head_ms``, and never below ``MIN_ODDS``; before anything is
    measured, when the odds are at least even."""
    if odds < MIN_ODDS:
        return False
    if ring_ms is None or head_ms is None:
        return odds >= 0.5
    return odds * (ring_ms + head_ms) >= (1.0 - odds) * head_ms


def _ema(old: float | None, new: float | None, weight: float) -> float | None:
    if new is None or not math.isfinite(new):
        return old
    return new if old is None else (1 - weight) * old + weight * new


Drafter = Callable[[Sequence[int], int], list[int]]
"""(the tokens so far, how many at most) -> drafts: the head's draft sources (``actors.node.speculation.drafts``)."""
