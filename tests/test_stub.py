"""The stub backend's issue #19 surface: logprobs, n > 1 forks, and refusing output constraints.

The stub is what protocol tests route through, so its forks and logprobs must behave like llama.cpp's: a fork
continues exactly where the session was, choice i draws with seed + i, and logprobs are a normalized
log-distribution over its vocabulary.
"""

from __future__ import annotations

import numpy as np
import pytest

from actors.backend import ForkingBackend, StepInput, StepOutput
from actors.backends.stub import StubBackend, StubConfig
from schemas.constraint import JsonObjectConstraint, ToolCallConstraint
from schemas.errors import BadRequestError, CapacityError
from schemas.session import SamplingParams
from schemas.tools import FunctionSpec

PROMPT = [256, *b"Once upon a time"]
N = 12


def chain(*bounds: int, max_sessions: int = 8) -> list[StubBackend]:
    return [StubBackend(StubConfig(n_layers=bounds[-1], layer_start=a, layer_end=b, max_sessions=max_sessions))
            for a, b in zip(bounds[:-1], bounds[1:], strict=False)]


def run(hops: list[StubBackend], items: list[StepInput]) -> list[StepOutput]:
    outs = hops[0].step(items)
    for hop in hops[1:]:
        items = [StepInput(i.session_id, i.start_position, hidden=o.hidden, sample=i.sample, forks=i.forks)
                 for i, o in zip(items, outs, strict=True)]
        outs = hop.step(items)
    return outs


def decode(hops: list[StubBackend], sampling: SamplingParams, n: int = 1) -> list[list[int]]:
    ids = ["s", *(f"s{i}" for i in range(1, n))]
    for hop in hops:
        hop.open_session("s", prompt_tokens=PROMPT, sampling=sampling)
    out = run(hops, [StepInput("s", 0, tokens=PROMPT, sample=True, forks=tuple(ids[1:]))])[0]
    picks = [[out.token], *([f.token] for f in out.forks)]
    while len(picks[0]) < N:
        at = len(PROMPT) + len(picks[0]) - 1
        outs = run(hops, [StepInput(sid, at, tokens=[p[-1]], sample=True) for sid, p in zip(ids, picks, strict=True)])
        for p, o in zip(picks, outs, strict=True):
            p.append(o.token)
    for hop in hops:
        for sid in ids:
            hop.close_session(sid)
    return picks  # type: ignore[return-value]


def test_the_stub_forks() -> None:
    assert isinstance(chain(0, 8)[0], ForkingBackend)


def test_greedy_choices_equal_the_unforked_session_through_a_chain() -> None:
    greedy = SamplingParams(temperature=0.0)
    alone = decode(chain(0, 8), greedy)[0]
    assert decode(chain(0, 3, 8), greedy, n=3) == [alone] * 3
    assert decode(chain(0, 8), greedy, n=3) == [alone] * 3


def test_choice_i_draws_with_seed_plus_i() -> None:
    choices = decode(chain(0, 4, 8), SamplingParams(temperature=1.0, seed=5), n=3)
    assert decode(chain(0, 4, 8), SamplingParams(temperature=1.0, seed=5), n=3) == choices
    assert len({tuple(c) for c in choices}) == 3
    # The stub is exact: each choice is the unforked session run with seed + i.
    for i, choice in enumerate(choices):
        assert decode(chain(0, 8), SamplingParams(temperature=1.0, seed=5 + i))[0] == choice


def test_logprobs_are_the_log_softmax_of_the_stub_logits() -> None:
    (tail,) = chain(0, 8)
    tail.open_session("s", prompt_tokens=PROMPT, sampling=SamplingParams(temperature=0.7, seed=1, logprobs=20))
    out = tail.step([StepInput("s", 0, tokens=PROMPT, sample=True)])[0]
    lp = out.logprobs
    assert lp is not None and lp.token == out.token and len(lp.top) == 20
    values = [c.logprob for c in lp.top]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    # The stub's own logits, normalized independently here.
    logits = tail.last_logits("s")
    ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert abs(lp.logprob - ref[out.token]) < 1e-9
    assert [c.token for c in lp.top] == [int(t) for t in np.argsort(-ref, kind="stable")[:20]]
    plain = chain(0, 8)[0]
    plain.open_session("s", prompt_tokens=PROMPT, sampling=SamplingParams(temperature=0.7, seed=1))
    again = plain.step([StepInput("s", 0, tokens=PROMPT, sample=True)])[0]
    assert again.logprobs is None and again.token == out.token  # asking for logprobs changes nothing else


@pytest.mark.parametrize("constraint", [JsonObjectConstraint(), ToolCallConstraint(tools=[FunctionSpec(name="f")])])
def test_output_constraints_are_refused_by_name(constraint: object) -> None:
    (tail,) = chain(0, 8)
    with pytest.raises(BadRequestError, match="stub backend does not enforce") as info:
        tail.open_session("s", prompt_tokens=PROMPT, sampling=SamplingParams(constraint=constraint))
    assert info.value.param == ("tools" if isinstance(constraint, ToolCallConstraint) else "response_format")
    head = chain(0, 4, 8)[0]  # only the tail samples: other hops take the session
    head.open_session("s", prompt_tokens=PROMPT, sampling=SamplingParams(constraint=constraint))


def test_forks_are_checked() -> None:
    (tail,) = chain(0, 8, max_sessions=3)
    tail.open_session("s", prompt_tokens=PROMPT, sampling=SamplingParams(temperature=0.0))
    with pytest.raises(BadRequestError, match="after the step that sampled"):
        tail.fork_session("s", ["a"])
    first = tail.step([StepInput("s", 0, tokens=PROMPT, sample=True)])[0].token
    with pytest.raises(CapacityError, match="do not fit"):
        tail.fork_session("s", ["a", "b", "c"])
    with pytest.raises(BadRequestError, match="new and distinct"):
        tail.fork_session("s", ["a", "a"])
    assert tail.open_sessions == ["s"]
    assert [o.token for o in tail.fork_session("s", ["a", "b"])] == [first, first]
    assert tail.open_sessions == ["s", "a", "b"]
