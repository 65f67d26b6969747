"""Comparing a recomputed receipt with what the checked node sent (issue #28). Pure: arrays in, a verdict out.

Three rules, chosen by what both sides computed with (tests/bench/bench_spot_checks.py measured every figure below
on the bundled model; docs/reliability.md §7):

* *exact*: nodes of one backend build computing every pass alone (no other session's rows in the batch, on both
  sides) produce the same bytes, so any difference is a wrong node.
* *band*: one kernel family (``kernels_id``: the same llama.cpp and CPU buffer types; the CPU features may differ,
  e.g. an AVX2 build against an AVX-512 one), judged on the *clean* positions, those before the first pass that
  shared its batch on either side. Such builds differ there by rounding only (relative L2 at most ~1e-6 per
  position), another quantization by ~1e-2 (Q8_0) to ~1e-1 (Q4_0): the receipt agrees when, at the median clean
  position, the relative L2 distance is within ``rel_tol`` and at least ``min_top_k`` of the checker's
  top-``top_k`` components (by magnitude) are among the receipt's.
* *wide*: another kernel family (plain against repacked kernels quantize activations differently: ~1.5e-2, as far
  as Q8_0), or no clean position (a shared pass in llama.cpp's unified KV rounds differently and the difference
  stays in the KV for every later position: up to ~2.4e-2). The loose ``wide_rel_tol`` still catches a grossly
  wrong node (Q4_0, skipped layers, noise); it cannot tell Q8_0 from these, and says so by its name.

The tail's receipts hold the top-k logits of each row it sampled from (``compare_logits``), judged the same way with
the ``logit_`` tolerances, except that a tail's receipt with no clean sampled position is not judged at all (honest
load noise in logits overlaps Q4_0's).

A greedy session's draws are checked too (``wrong_draw``): each drawn token must be the argmax of the checker's
logits wherever that argmax is certain: any lead under the exact rule, a lead of ``DRAW_LEAD`` of the top logit's
magnitude otherwise (far beyond load noise, ~8e-2 of the L2 norm). A tail that computes right and draws wrong is
caught so; a sampled session's draws are not checked (that needs the sampler replayed with its state).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import numpy.typing as npt

from actors.backend import Hidden, TopLogits
from schemas.session import SamplingParams
from schemas.spot_check import SpotVerdict

Rule = Literal["exact", "band", "wide"]


@dataclasses.dataclass(frozen=True)
class Band:
    rel_tol: float
    """At the median clean position: |a - b| / |b| (L2) of the boundary states."""
    top_k: int
    """How many components (hidden states: largest magnitudes; the tail: largest logits) the overlap counts."""
    min_top_k: float
    """At the median judged position: the least share of the checker's top-k that the receipt's top-k holds."""
    logit_rel_tol: float = 1e-2
    """The tail's: at the median clean sampled position, |a - b| / |b| (L2) of the logits of the ids both hold."""
    wide_rel_tol: float = 5e-2
    """``rel_tol`` across kernel families, or when no position is clean (the receipt's first pass shared its
    batch)."""
    wide_logit_rel_tol: float = 4e-2
    """``logit_rel_tol`` across kernel families (a tail's receipt with no clean position is not judged)."""


def compare(claimed: list[Hidden], recomputed: list[Hidden], *, exact_rule: bool, band: Band, node_id: str,
            build_id: str, start: int = 0, clean: int | None = None, same_kernels: bool = True) -> SpotVerdict:
    """Frames in order (the receipt's); positions counted from ``start``; ``clean``: how many leading positions
    both sides computed in passes of their own (None: all). An honest node under load differs at the positions
    after a shared pass; a wrong node at all of them."""
    flat_a = [a.reshape(a.shape[0], -1) for a in claimed]
    flat_b = [b.reshape(b.shape[0], -1) for b in recomputed]
    if len(flat_a) != len(flat_b) or any(a.shape != b.shape for a, b in zip(flat_a, flat_b, strict=False)):
        return _mismatch(node_id, build_id, "exact" if exact_rule else "band", start)
    a2, b2 = np.concatenate(flat_a), np.concatenate(flat_b)
    rel = np.linalg.norm(a2 - b2, axis=1) / np.maximum(np.linalg.norm(b2, axis=1), 1e-12)
    rel = np.where(np.isfinite(rel), rel, 1e9)
    top = _top_k_overlap(a2, b2, band.top_k)
    same = np.all(a2 == b2, axis=1)
    return _verdict(rel, top, same, exact_rule=exact_rule, same_kernels=same_kernels, clean=clean,
                    tol=band.rel_tol, wide_tol=band.wide_rel_tol, min_top_k=band.min_top_k,
                    positions=start + np.arange(len(rel)), node_id=node_id, build_id=build_id)


def compare_logits(claimed: list[TopLogits], recomputed: list[TopLogits], *, exact_rule: bool, band: Band,
                   node_id: str, build_id: str, positions: list[int], clean: int | None = None,
                   same_kernels: bool = True) -> SpotVerdict:
    """A tail's receipt: at each position it sampled a token after (``positions``), the largest logits it sampled
    from against the checker's. Per position: the share of the checker's top-k ids that the receipt holds, and the
    relative L2 distance of the logits of the ids both hold. Judged as ``compare`` judges boundary states."""
    if len(claimed) != len(recomputed) or not recomputed or len(positions) != len(recomputed) or any(
            a.ids.shape != b.ids.shape for a, b in zip(claimed, recomputed, strict=False)):
        return _mismatch(node_id, build_id, "exact" if exact_rule else "band", positions[0] if positions else 0)
    rel, top = np.empty(len(claimed)), np.empty(len(claimed))
    same = np.empty(len(claimed), dtype=bool)
    for i, (a, b) in enumerate(zip(claimed, recomputed, strict=True)):
        common, ia, ib = np.intersect1d(a.ids, b.ids, assume_unique=True, return_indices=True)
        top[i] = len(common) / len(b.ids)
        ref = float(np.linalg.norm(b.values[ib])) if len(common) else 0.0
        rel[i] = float(np.linalg.norm(a.values[ia] - b.values[ib])) / ref if ref > 0 else 1e9
        same[i] = bool(np.array_equal(a.ids, b.ids) and np.array_equal(a.values, b.values))
    rel = np.where(np.isfinite(rel), rel, 1e9)
    return _verdict(rel, top, same, exact_rule=exact_rule, same_kernels=same_kernels, clean=clean,
                    tol=band.logit_rel_tol, wide_tol=band.wide_logit_rel_tol, min_top_k=band.min_top_k,
                    positions=np.asarray(positions), node_id=node_id, build_id=build_id, loaded=False)


DRAW_LEAD = 0.2
"""Outside the exact rule, a drawn token is judged only where the checker's top logit leads the second by this share
of its magnitude (at least 1): an argmax no honest rounding or batch noise moves."""


def argmax_draws(sampling: SamplingParams) -> bool:
    """Every token the session draws is the argmax of the raw logits: greedy, with nothing that reshapes them."""
    return (sampling.temperature == 0 and sampling.repeat_penalty == 1 and sampling.presence_penalty == 0
            and sampling.frequency_penalty == 0 and sampling.constraint is None)


def wrong_draw(drawn: list[int | None], recomputed: list[TopLogits], positions: list[int], *,
               exact_rule: bool) -> int | None:
    """The first position whose drawn token is not the checker's certain argmax, or None."""
    for token, top, position in zip(drawn, recomputed, positions, strict=True):
        if token is None or len(top.values) < 2:
            continue
        lead = float(top.values[0] - top.values[1])
        certain = lead > 0 if exact_rule else lead > DRAW_LEAD * max(1.0, abs(float(top.values[0])))
        if certain and token != int(top.ids[0]):
            return position
    return None


def _verdict(rel: npt.NDArray[np.float64], top: npt.NDArray[np.float64], same: npt.NDArray[np.bool_], *,
             exact_rule: bool, same_kernels: bool, clean: int | None, tol: float, wide_tol: float, min_top_k: float,
             positions: npt.NDArray[np.int_], node_id: str, build_id: str, loaded: bool = True) -> SpotVerdict:
    """``loaded``: with no clean position, judge every position with ``wide_tol`` (else judge nothing)."""
    exact = bool(same.all())
    judged = np.ones(len(rel), dtype=bool) if clean is None else positions < clean
    rule: Rule
    if exact_rule:
        rule, agree, off = "exact", exact, ~same
    elif not judged.any() and not loaded:
        # The tail's logits after a shared pass: honest load noise (up to 8e-2 per position, measured) overlaps
        # Q4_0's (7e-2 to 1.5e-1 at the median): nothing is judged, nobody is accused.
        return SpotVerdict(node_id=node_id, build_id=build_id, agree=True, exact=exact, rule="wide",
                           positions=len(rel), judged=0, max_rel_err=min(float(rel.max()), 1e9),
                           median_rel_err=min(float(np.median(rel)), 1e9), min_top_k=float(top.min()),
                           median_top_k=float(np.median(top)))
    else:
        if not judged.any():  # the first pass shared its batch: every position, loosely
            judged = np.ones(len(rel), dtype=bool)
            rule, tol = "wide", wide_tol
        elif not same_kernels:
            rule, tol = "wide", wide_tol
        else:
            rule = "band"
        agree = float(np.median(rel[judged])) <= tol and float(np.median(top[judged])) >= min_top_k
        off = judged & ((rel > tol) | (top < min_top_k))
    median_rel, median_top = float(np.median(rel[judged])), float(np.median(top[judged]))
    first_bad = None if agree or not off.any() else int(positions[int(np.argmax(off))])
    return SpotVerdict(node_id=node_id, build_id=build_id, agree=agree, exact=exact, rule=rule,
                       positions=len(rel), judged=int(judged.sum()), max_rel_err=min(float(rel.max()), 1e9),
                       median_rel_err=min(median_rel, 1e9), min_top_k=float(top.min()), median_top_k=median_top,
                       first_bad=first_bad)


def _mismatch(node_id: str, build_id: str, rule: Rule, first: int) -> SpotVerdict:
    return SpotVerdict(node_id=node_id, build_id=build_id, agree=False, exact=False, rule=rule, positions=0,
                       max_rel_err=1e9, median_rel_err=1e9, min_top_k=0.0, median_top_k=0.0, first_bad=first)


def _top_k_overlap(a: Hidden, b: Hidden, k: int) -> npt.NDArray[np.float64]:
    """Per row: the share of ``b``'s top-k components (by magnitude) that are among ``a``'s."""
    k = min(k, a.shape[1])
    ta = np.argpartition(-np.abs(a), k - 1, axis=1)[:, :k]
    tb = np.argpartition(-np.abs(b), k - 1, axis=1)[:, :k]
    overlap = [len(np.intersect1d(x, y, assume_unique=True)) / k for x, y in zip(ta, tb, strict=True)]
    return np.asarray(overlap, dtype=np.float64)
