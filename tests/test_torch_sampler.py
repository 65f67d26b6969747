"""The tail's sampler on hand-made logits: every expectation is computed here from the logits themselves."""

from __future__ import annotations

import collections

import pytest
import torch

from actors.backends.torch.sampler import TorchSampler
from schemas.session import SamplingParams


def logits_of(seed: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_exactly_argmax() -> None:
    for seed in range(20):
        logits = logits_of(seed)
        assert TorchSampler(SamplingParams(temperature=0.0), []).sample(logits) == int(torch.argmax(logits))


def test_same_seed_same_draws_other_seed_other_draws() -> None:
    logits = logits_of(0)

    def draws(seed: int) -> list[int]:
        sampler = TorchSampler(SamplingParams(temperature=1.0, seed=seed), [])
        return [sampler.sample(logits) for _ in range(64)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_temperature_sampling_follows_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    temperature, n = 0.8, 20_000
    sampler = TorchSampler(SamplingParams(temperature=temperature, seed=3), [])
    counts = collections.Counter(sampler.sample(logits) for _ in range(n))
    expected = torch.softmax(logits / temperature, dim=-1)
    for token in range(4):
        # ~5 standard deviations of a binomial proportion at this n.
        tolerance = 5 * float((expected[token] * (1 - expected[token]) / n) ** 0.5)
        assert abs(counts[token] / n - float(expected[token])) < tolerance


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=2.0, top_k=1, seed=1),
    SamplingParams(temperature=2.0, top_p=1e-6, seed=1),
    SamplingParams(temperature=2.0, min_p=0.999, seed=1),
])
def test_truncation_to_one_candidate_is_greedy(params: SamplingParams) -> None:
    for seed in range(10):
        logits = logits_of(seed)
        assert TorchSampler(params, []).sample(logits) == int(torch.argmax(logits))


def test_top_k_and_top_p_only_draw_from_the_kept_set() -> None:
    logits = logits_of(5) / 3  # flat enough that the 0.6 nucleus holds several tokens
    top3 = set(torch.topk(logits, 3).indices.tolist())
    sampler = TorchSampler(SamplingParams(temperature=1.5, top_k=3, seed=4), [])
    assert {sampler.sample(logits) for _ in range(300)} <= top3
    probs = torch.softmax(logits, dim=-1)
    order = torch.argsort(probs, descending=True)
    mass = torch.cumsum(probs[order], dim=-1)
    nucleus = set(order[: int((mass < 0.6).sum()) + 1].tolist())
    sampler = TorchSampler(SamplingParams(temperature=1.5, top_p=0.6, seed=4), [])
    drawn = {sampler.sample(logits) for _ in range(300)}
    assert len(nucleus) > 1 and drawn <= nucleus and len(drawn) > 1


def test_penalties_follow_llama_cpp_arithmetic() -> None:
    logits = torch.tensor([3.0, 2.9, -1.0, 0.5])
    history = [0, 0, 2]
    p = SamplingParams(temperature=0.0, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    expected = logits.clone()
    for token, count in collections.Counter(history).items():
        value = expected[token]
        value = value / p.repeat_penalty if value > 0 else value * p.repeat_penalty
        expected[token] = value - count * p.frequency_penalty - p.presence_penalty
    sampler = TorchSampler(p, history)
    assert torch.allclose(sampler._penalize(logits), expected)
    # Token 0 led before the penalty; after it the next best, token 1, wins the greedy pick.
    assert int(torch.argmax(logits)) == 0 and sampler.sample(logits) == int(torch.argmax(expected)) == 1


def test_penalty_window_forgets_old_tokens() -> None:
    logits = torch.tensor([3.0, 2.9])
    p = SamplingParams(temperature=0.0, repeat_penalty=2.0, penalty_last_n=1)
    assert TorchSampler(p, [1, 0]).sample(logits) == 1  # token 0 is in the last-1 window: 3.0 / 2 < 2.9
    assert TorchSampler(p, [0, 1]).sample(logits) == 0  # now it fell out, and token 1 is penalized


def test_a_sampler_started_over_and_told_the_tokens_so_far_draws_what_the_original_drew() -> None:
    """Issue #18's ``replay_sampled``: draw ``k`` depends on the seed and ``k`` only, and penalties see the replayed
    tokens, so a rebuilt tail continues a seeded stream unchanged."""
    p = SamplingParams(temperature=1.5, seed=21, repeat_penalty=1.4, penalty_last_n=4)
    prompt = [3, 4, 5]
    steps = [logits_of(100 + i, vocab=8) for i in range(40)]
    original = TorchSampler(p, prompt)
    stream = [original.sample(logits) for logits in steps]
    restarted = TorchSampler(p, prompt)
    for token in stream[:25]:
        restarted.accept(token)
    assert restarted.generated == 25
    assert [restarted.sample(logits) for logits in steps[25:]] == stream[25:]
    # Without the replay the same sampler draws another continuation: the replay is what makes them agree.
    fresh = TorchSampler(p, prompt)
    assert [fresh.sample(logits) for logits in steps[25:]] != stream[25:]


def test_choice_seeds_do_not_share_draws_shifted_by_one() -> None:
    """Choice ``i`` of an n > 1 request streams with ``seed + i``: its draws are not choice ``i - 1``'s shifted."""
    logits = logits_of(7, vocab=1000) / 10  # nearly flat: draws tell the generators apart

    def draws(seed: int) -> list[int]:
        sampler = TorchSampler(SamplingParams(temperature=1.0, seed=seed), [])
        return [sampler.sample(logits) for _ in range(32)]

    first, second = draws(5), draws(6)
    assert first[1:] != second[:-1] and first != second
