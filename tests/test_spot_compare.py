"""The comparison of a recomputed receipt (issue #28): the exact rule, the band at the median position."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from actors.backend import Backend, StepInput, TopLogits
from actors.node.spot_compare import DRAW_LEAD, Band, argmax_draws, compare, compare_logits, wrong_draw
from schemas.constraint import JsonObjectConstraint
from schemas.session import SamplingParams
from schemas.spot_check import SpotVerdict

BAND = Band(rel_tol=1e-3, top_k=8, min_top_k=0.75)
rng = np.random.default_rng(0)


def frames(n: int = 10) -> list[np.ndarray]:
    return [rng.normal(0, 100, (4, 64)).astype(np.float32) for _ in range(n // 4)] + \
        [rng.normal(0, 100, (1, 64)).astype(np.float32) for _ in range(n - n // 4 * 4)]


def test_identical_outputs_agree_exactly_under_either_rule() -> None:
    ref = frames()
    for exact_rule in (True, False):
        v = compare([f.copy() for f in ref], ref, exact_rule=exact_rule, band=BAND, node_id="c", build_id="b")
        assert v.agree and v.exact and v.max_rel_err == 0 and v.first_bad is None
        assert v.positions == sum(f.shape[0] for f in ref)


def test_one_ulp_fails_the_exact_rule_but_not_the_band() -> None:
    ref = frames()
    off = [f.copy() for f in ref]
    off[0][1, 3] = np.nextafter(off[0][1, 3], np.float32(np.inf))
    exact = compare(off, ref, exact_rule=True, band=BAND, node_id="c", build_id="b")
    assert not exact.agree and not exact.exact and exact.first_bad == 1 and exact.rule == "exact"
    assert compare(off, ref, exact_rule=False, band=BAND, node_id="c", build_id="b").agree


def test_the_band_judges_the_median_position() -> None:
    ref = frames(12)
    few = [f.copy() for f in ref]
    few[0][0] += 50.0  # one position of twelve far off: an honest node's batch noise
    v = compare(few, ref, exact_rule=False, band=BAND, node_id="c", build_id="")
    assert v.agree and v.max_rel_err > 0.1 and v.median_rel_err == 0
    every = [f + rng.normal(0, 5, f.shape).astype(np.float32) for f in ref]  # every position off: a wrong node
    v = compare(every, ref, exact_rule=False, band=BAND, node_id="c", build_id="")
    assert not v.agree and v.median_rel_err > BAND.rel_tol and v.first_bad is not None


def test_only_greedy_unshaped_draws_are_argmax_draws() -> None:
    assert argmax_draws(SamplingParams(temperature=0))
    for shaped in (SamplingParams(), SamplingParams(temperature=0, repeat_penalty=1.1),
                   SamplingParams(temperature=0, presence_penalty=0.5),
                   SamplingParams(temperature=0, frequency_penalty=0.5),
                   SamplingParams(temperature=0, constraint=JsonObjectConstraint())):
        assert not argmax_draws(shaped), shaped


def test_a_drawn_token_must_be_the_certain_argmax() -> None:
    def top(*values: float) -> TopLogits:
        return TopLogits(ids=np.arange(len(values), dtype=np.int32) + 10, values=np.array(values, np.float32))

    clear, close = top(20.0, 10.0, 1.0), top(20.0, 19.0, 1.0)
    assert wrong_draw([10, 10], [clear, close], [5, 6], exact_rule=False) is None
    assert wrong_draw([None, 11], [clear, clear], [5, 6], exact_rule=False) == 6
    # Within the lead honest noise may move, another draw is not judged; under the exact rule any lead counts.
    assert DRAW_LEAD * 20.0 > 1.0
    assert wrong_draw([11], [close], [5], exact_rule=False) is None
    assert wrong_draw([11], [close], [5], exact_rule=True) == 5
    assert wrong_draw([11], [top(20.0, 20.0)], [5], exact_rule=True) is None  # a tie: either is the argmax


def test_a_mismatched_shape_disagrees() -> None:
    ref = frames(4)
    v = compare([np.zeros((3, 64), np.float32)], ref, exact_rule=False, band=BAND, node_id="c", build_id="")
    assert not v.agree and v.positions == 0


# ---- the band on real boundary states and logits: the bundled model, another build, two other quantizations ------

def _top(rows: np.ndarray, k: int) -> list[TopLogits]:
    return [TopLogits.of(r, k) for r in rows]


@pytest.mark.slow
def test_the_band_passes_another_build_and_catches_other_quantizations(gemma_path: Path, tmp_path: Path) -> None:
    """Layers 6:12 and the tail 12:18 recompute what layers 0:6 sent for a prompt and 8 decode steps, on the
    default build, on another one (llama.cpp's plain CPU kernels instead of the repacked ones: another build_id,
    other rounding at most positions), and on the same layers of the model requantized to Q8_0 and Q4_0. Under the
    band (the rule across builds) the other build agrees and both quantizations are caught, for the boundary states
    and for the tail's top logits; the exact rule would have failed the other build."""
    pytest.importorskip("llama_cpp")
    from actors.backends import load_backend
    from actors.node.build_id import build_id
    from actors.node.spot_check import band_of
    from schemas.session import Prompt, SamplingParams
    from schemas.settings import Settings
    from tests.support.requantize import requantize

    band = band_of(Settings())
    greedy = SamplingParams(temperature=0)

    def shard(path: Path, start: int, end: int, name: str, **options: object) -> Backend:
        return load_backend("llamacpp", model_path=path, n_ctx=256, max_sessions=1, threads=1, layer_start=start,
                            layer_end=end, shard_dir=tmp_path / name, **options)

    head = shard(gemma_path, 0, 6, "head")
    prompt = head.tokenize(Prompt(text="Here is a short story about a lighthouse keeper who finds a message"))
    head.open_session("s", prompt_tokens=prompt, sampling=greedy)
    frames = [head.step([StepInput("s", 0, tokens=prompt)])[0].hidden]
    frames += [head.step([StepInput("s", len(prompt) + i, tokens=[200 + i])])[0].hidden for i in range(8)]
    head.close()
    assert all(f is not None for f in frames)

    def run(backend: Backend, inputs: list[np.ndarray]) -> tuple[list[np.ndarray], list[TopLogits]]:
        backend.open_session("c", prompt_tokens=prompt, sampling=greedy)
        hidden, top, at = [], [], 0
        for f in inputs:
            out = backend.step([StepInput("c", at, hidden=f, sample=backend.is_tail,
                                          top_k=band.top_k if backend.is_tail else 0)])[0]
            if backend.is_tail:
                assert out.top is not None
                top.append(out.top)
            else:
                assert out.hidden is not None
                hidden.append(np.array(out.hidden, copy=True))
            at += f.shape[0]
        backend.close()
        return hidden, top

    quants = {kind: requantize(gemma_path, tmp_path / "quant", kind) for kind in ("q8_0", "q4_0")}
    reference = shard(gemma_path, 6, 12, "ref")
    plain = shard(gemma_path, 6, 12, "plain", extra_buffers=False)
    assert build_id(plain.info) != build_id(reference.info)  # it advertises another build
    ref_hidden, _ = run(reference, frames)  # type: ignore[arg-type]
    mids = {"other build": run(plain, frames)[0]}  # type: ignore[arg-type]
    mids |= {kind: run(shard(path, 6, 12, kind), frames)[0] for kind, path in quants.items()}  # type: ignore[arg-type]
    tails = {"reference": shard(gemma_path, 12, 18, "ref-tail"),
             "other build": shard(gemma_path, 12, 18, "plain-tail", extra_buffers=False),
             **{kind: shard(path, 12, 18, f"{kind}-tail") for kind, path in quants.items()}}
    tops = {name: run(backend, ref_hidden)[1] for name, backend in tails.items()}
    sampled = list(range(len(prompt) - 1, len(prompt) + 8))

    def hidden_verdict(name: str, *, same_kernels: bool, exact_rule: bool = False) -> SpotVerdict:
        return compare(mids[name], ref_hidden, exact_rule=exact_rule, same_kernels=same_kernels, band=band,
                       node_id="c", build_id="")

    def tail_verdict(name: str, *, same_kernels: bool) -> SpotVerdict:
        return compare_logits(tops[name], tops["reference"], exact_rule=False, same_kernels=same_kernels, band=band,
                              node_id="c", build_id="", positions=sampled)

    # The other build is another kernel family: the wide band passes it, the tight one (and the exact rule) would
    # not, so the family must choose the band.
    other = hidden_verdict("other build", same_kernels=False)
    assert other.agree and other.rule == "wide" and other.judged == other.positions and not other.exact
    assert not hidden_verdict("other build", same_kernels=True).agree
    assert not hidden_verdict("other build", same_kernels=True, exact_rule=True).agree
    assert tail_verdict("other build", same_kernels=False).agree
    # A requantized node of the checker's own kernel family is caught by the tight band, Q8_0 included; Q4_0 by the
    # wide one too.
    for kind in quants:
        v, t = hidden_verdict(kind, same_kernels=True), tail_verdict(kind, same_kernels=True)
        assert not v.agree and v.rule == "band" and v.median_rel_err > 10 * band.rel_tol, (kind, v)
        assert not t.agree and t.rule == "band", (kind, t)
    assert not hidden_verdict("q4_0", same_kernels=False).agree
    assert not tail_verdict("q4_0", same_kernels=False).agree
