"""actors.node.speculation.policy: the tail's acceptance rule keeps the model's distribution exactly, greedy windows
give
plain greedy's tokens, and the window sizer turns speculation off where it cannot pay (issue #20)."""

from __future__ import annotations

import numpy as np
import pytest

from actors.node.speculation.policy import Target, WindowSizer, best_k, expected_tokens, verify, worth_optimism

VOCAB = 6


def rows_for(*dists: list[float]) -> np.ndarray:
    with np.errstate(divide="ignore"):  # a zero probability is a logit of -inf
        return np.log(np.asarray(dists, dtype=np.float64))


def test_greedy_accepts_the_longest_agreeing_prefix_then_the_rows_own_pick() -> None:
    rows = rows_for([0.1, 0.6, 0.1, 0.1, 0.05, 0.05], [0.7, 0.1, 0.1, 0.05, 0.025, 0.025],
                    [0.1, 0.1, 0.1, 0.6, 0.05, 0.05], [0.2] * 5 + [0.0])
    greedy = Target()
    assert verify(rows, [1, 0, 3], greedy, start=10, seed=None).tokens == [1, 0, 3, 0]
    verdict = verify(rows, [1, 2, 3], greedy, start=10, seed=None)
    assert verdict.tokens == [1, 0] and verdict.accepted == 1
    assert verify(rows[:1], [], greedy, start=10, seed=None).tokens == [1]
    with pytest.raises(ValueError, match="rows"):
        verify(rows, [1], greedy, start=0, seed=None)


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_the_first_token_is_distributed_as_plain_sampling_whatever_the_draft(draft: int) -> None:
    p = np.array([0.05, 0.4, 0.25, 0.15, 0.1, 0.05])
    rows = rows_for(list(p), [1 / VOCAB] * VOCAB)
    target = Target(temperature=1.0)
    n = 20000
    counts = np.bincount([verify(rows, [draft], target, start=s * 7, seed=s).tokens[0] for s in range(n)],
                         minlength=VOCAB)
    # Five standard errors of a binomial count: a rule that kept drafts too often (or never) fails by far more.
    tolerance = 5 * np.sqrt(n * p * (1 - p)) + 1
    assert np.all(np.abs(counts - n * p) <= tolerance), (counts, n * p)


def test_a_draft_model_distribution_is_corrected_by_the_residual() -> None:
    p = np.array([0.5, 0.2, 0.2, 0.1, 0.0, 0.0])
    q = np.array([0.1, 0.6, 0.1, 0.1, 0.05, 0.05])  # the draft source's own (worse) distribution
    target = Target(temperature=1.0)
    rows = rows_for(list(p + 1e-12), [1 / VOCAB] * VOCAB)
    rng = np.random.default_rng(3)
    n = 20000
    firsts = []
    for s in range(n):
        d = int(rng.choice(VOCAB, p=q))
        firsts.append(verify(rows, [d], target, start=s, seed=s + 1, draft_dists=[q]).tokens[0])
    counts = np.bincount(firsts, minlength=VOCAB)
    assert np.all(np.abs(counts - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1), (counts, n * p)


def test_a_seeded_window_is_the_same_every_time_and_truncation_follows_llama_cpp() -> None:
    rows = rows_for([0.3, 0.3, 0.2, 0.1, 0.05, 0.05], [0.2] * 5 + [0.0], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    target = Target(temperature=0.8, top_k=3)
    assert verify(rows, [1, 4], target, start=5, seed=9) == verify(rows, [1, 4], target, start=5, seed=9)
    p = Target(temperature=1.0, top_k=2).probs(rows[0])
    assert np.count_nonzero(p) == 2 and p.sum() == pytest.approx(1.0)
    assert np.count_nonzero(Target(temperature=1.0, top_p=0.5).probs(rows[0])) == 2
    assert np.count_nonzero(Target(temperature=1.0, min_p=0.7).probs(rows[0])) == 2


def test_the_sizer_picks_long_windows_when_the_ring_dominates_and_none_when_drafts_fail() -> None:
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert best_k(0.9, fixed_ms=40.0, position_ms=1.0, limit=8) == 8
    assert best_k(0.0, fixed_ms=40.0, position_ms=1.0, limit=8) == 0
    assert best_k(0.3, fixed_ms=2.0, position_ms=5.0, limit=8) == 0  # each draft costs more than it brings
    sizer = WindowSizer(max_k=6, start=3)
    assert sizer.next_k(available=10) == 3 and sizer.next_k(available=1) == 1
    for _ in range(20):
        sizer.observe(offered=4, accepted=0, ring_ms=10.0, base_ms=20.0, position_ms=2.0)
    assert sizer.next_k(available=10) == 0 and sizer.mean_accepted == 0.0
    for _ in range(20):
        sizer.observe(offered=4, accepted=4, ring_ms=30.0, base_ms=20.0, position_ms=1.0)
    assert sizer.next_k(available=10) == 6 and sizer.mean_accepted == 2.0


def test_the_sizer_probes_again_after_turning_speculation_off_and_backs_off_while_probes_fail() -> None:
    sizer = WindowSizer(max_k=6, start=3, probe_after=4)
    sizer.observe(offered=3, accepted=0, ring_ms=10.0, base_ms=20.0, position_ms=5.0)
    probes = []
    for window in range(60):
        k = sizer.next_k(available=6)
        if k:
            probes.append(window)
        sizer.observe(offered=k, accepted=0, ring_ms=10.0, base_ms=20.0, position_ms=5.0)
    assert probes == [4, 13, 30], probes  # after 4 plain windows, then 8, then 16: probing costs ever less
    assert sizer.next_k(available=6) == 0
    for _ in range(60):
        sizer.observe(offered=0, accepted=0)
    assert sizer.next_k(available=6) == 1
    sizer.observe(offered=1, accepted=1, ring_ms=10.0, base_ms=20.0, position_ms=5.0)
    assert sizer._probe_wait == 4  # a probe that paid: the next comes as soon as the first did


def test_a_window_goes_in_flight_behind_another_when_its_odds_pay_for_the_heads_pass() -> None:
    assert not worth_optimism(0.15, ring_ms=100.0, head_ms=1.0)  # never on poor odds
    assert not worth_optimism(0.4, ring_ms=None, head_ms=None) and worth_optimism(0.5, ring_ms=None, head_ms=None)
    assert worth_optimism(0.3, ring_ms=40.0, head_ms=20.0)  # a long ring: a good window saves it whole
    assert not worth_optimism(0.3, ring_ms=2.0, head_ms=20.0)  # loopback: the pass is mostly wasted
