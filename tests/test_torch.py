"""The torch backend as route hops: backend instances chained in-process through real activation frames.

Every expected value comes from transformers run in one process on the same weights (``generate`` and a full
forward pass), computed inside the test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.backend import Backend, StepInput
from actors.backends import load_backend
from actors.backends.torch.backend import TorchBackend
from bus import frame as frames
from schemas.errors import (
    BadRequestError,
    CapacityError,
    ContextLengthError,
    FrameError,
    SessionNotFoundError,
)
from schemas.session import Prompt, SamplingParams
from tests.support.torch_route import GREEDY, LONG_PROMPT, WireRoute, build_route, generate_reference, reference


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("bounds", [(0, 3, 6), (0, 2, 4, 6)], ids=["2-node", "3-node"])
def test_route_greedy_tokens_equal_generate(model: str, bounds: tuple[int, ...]) -> None:
    ref = reference(model)
    route = WireRoute(build_route(model, bounds))
    ids = route.backends[0].tokenize(Prompt(text=LONG_PROMPT))
    window = getattr(ref.config, "sliding_window", None)
    if window is not None:
        assert len(ids) > 4 * window, "the prompt must outgrow the sliding window"
    expected = generate_reference(ref, ids, 24)

    sid, got = route.generate(ids, len(expected))

    assert got == expected
    # Every hop's output, prefill chunks and decode steps alike, is the single-process hidden state at that depth.
    with torch.no_grad():
        states = ref(torch.tensor([ids + got[:-1]]), output_hidden_states=True).hidden_states
    for hop, boundary in enumerate(bounds[1:-1]):
        sent, desired = np.concatenate(route.hop_outputs[sid][hop]), states[boundary][0].numpy()
        # Chunked vs whole-sequence matmuls round differently: allow float32 noise relative to the state's scale.
        np.testing.assert_allclose(sent, desired, rtol=1e-4, atol=2e-5 * float(np.abs(desired).max()))


def test_gemma3_split_mixes_sliding_and_global_layers() -> None:
    """Guards the premise of the tests above: each node of the 2- and 3-node splits meets both kinds somewhere."""
    ref = reference("tiny-gemma3")
    kinds = ref.config.layer_types
    assert {kinds[i] for i in range(0, 3)} == {kinds[i] for i in range(3, 6)} == {"sliding_attention",
                                                                                    "full_attention"}
    assert kinds[0:2] == ["sliding_attention"] * 2 and "full_attention" in kinds[2:4] and "full_attention" in kinds[4:6]


def test_decode_hop_payload_is_one_position_whatever_the_context() -> None:
    route = WireRoute(build_route("tiny-gemma3", (0, 3, 6)))
    hidden = route.backends[0].info.hidden_size
    decode_bytes = {}
    for length in (20, 400):
        ids = [2] + [3 + (i * 7) % 250 for i in range(length - 1)]
        sid, _ = route.generate(ids, 4, chunk=64)
        per_hop = route.wire_bytes[sid][0]
        n_prefill = -(-length // 64)
        decode_bytes[length] = set(per_hop[n_prefill:])
        assert max(per_hop[:n_prefill]) == frames.header_size(1, 0) + min(64, length) * hidden * 4
    one_position = frames.header_size(1, 0) + hidden * 4
    assert decode_bytes[20] == decode_bytes[400] == {one_position}


def test_concurrent_sessions_on_the_same_nodes_stay_isolated() -> None:
    ref = reference("tiny-llama")
    route = WireRoute(build_route("tiny-llama", (0, 2, 4, 6)))
    tok = route.backends[0].tokenize
    a_ids, b_ids = tok(Prompt(text=LONG_PROMPT)), tok(Prompt(text="Pack my box with five dozen liquor jugs."))
    a_ref, b_ref = generate_reference(ref, a_ids, 12), generate_reference(ref, b_ids, 12)
    a, b = route.open(a_ids), route.open(b_ids)
    # Prefill interleaved chunk by chunk, then decode both sessions in the same batched step on every hop.
    a_tok = b_tok = None
    for start in range(0, max(len(a_ids), len(b_ids)), 9):
        items = [(sid, start, ids[start:start + 9], start + 9 >= len(ids))
                 for sid, ids in ((a, a_ids), (b, b_ids)) if start < len(ids)]
        for (sid, *_), token in zip(items, route.step(items), strict=True):
            a_tok, b_tok = (token, b_tok) if sid == a else (a_tok, token)
    assert a_tok is not None and b_tok is not None
    a_got, b_got = [a_tok], [b_tok]
    while len(a_got) < 12:
        tokens = route.step([(a, len(a_ids) + len(a_got) - 1, [a_got[-1]], True),
                             (b, len(b_ids) + len(b_got) - 1, [b_got[-1]], True)])
        a_got.append(int(tokens[0]))  # type: ignore[arg-type]
        b_got.append(int(tokens[1]))  # type: ignore[arg-type]
    assert a_got[:len(a_ref)] == a_ref and b_got[:len(b_ref)] == b_ref
    # Freeing one session's KV leaves the other's intact and accounted for.
    middle = route.backends[1]
    both = middle.kv_bytes_in_use()
    middle.close_session(a)
    middle.close_session(a)  # idempotent
    assert 0 < middle.kv_bytes_in_use() < both
    assert middle.open_sessions == [b]


def test_node_materializes_only_its_layers() -> None:
    ref = reference("tiny-gemma3")
    params = dict(ref.named_parameters())

    def expected_bytes(*prefixes: str) -> int:
        return sum(p.numel() * p.element_size() for n, p in params.items() if n.startswith(prefixes))

    head, middle, tail = build_route("tiny-gemma3", (0, 2, 4, 6))
    assert middle.shard.embed is None and middle.shard.lm_head is None and sorted(middle.shard.layers) == [2, 3]
    assert middle.shard.parameter_bytes() == expected_bytes("model.layers.2.", "model.layers.3.")
    assert head.shard.parameter_bytes() == expected_bytes("model.embed_tokens.", "model.layers.0.", "model.layers.1.")
    # The tail of a tied model reads the embedding matrix as its LM head (and nothing else of the head's).
    assert tail.shard.lm_head is not None
    assert torch.equal(tail.shard.lm_head.weight, params["model.embed_tokens.weight"])
    assert tail.shard.parameter_bytes() == expected_bytes("model.embed_tokens.", "model.layers.4.",
                                                          "model.layers.5.", "model.norm.")


def test_kv_cache_holds_only_own_layers_and_sliding_layers_stay_bounded() -> None:
    route = WireRoute(build_route("tiny-gemma3", (0, 2, 4, 6)))
    cfg = route.backends[0].prepared.config
    window, kv_row = cfg.sliding_window, 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # keys + values, float32
    ids = [2] + [3 + i % 200 for i in range(99)]
    route.generate(ids, 3)
    positions = len(ids) + 2  # the last sampled token has not been fed back yet
    for backend in route.backends:
        kinds = [cfg.layer_types[i] for i in range(backend.layers.start, backend.layers.end)]
        rows = sum(positions if k == "full_attention" else min(positions, window - 1) for k in kinds)
        assert backend.kv_bytes_in_use() == rows * kv_row


def test_seeded_sampling_reproduces_and_seeds_differ() -> None:
    route = WireRoute(build_route("tiny-llama", (0, 3, 6)))
    ids = route.backends[0].tokenize(Prompt(text=LONG_PROMPT))

    def run(seed: int, **extra: float) -> list[int]:
        return route.generate(ids, 16, sampling=SamplingParams(temperature=1.5, seed=seed, **extra))[1]

    first = run(7)
    assert run(7) == first
    assert run(8) != first
    # top_k=1 leaves only the argmax: sampling collapses to greedy whatever the temperature.
    greedy = route.generate(ids, 16)[1]
    assert run(9, top_k=1) == greedy


def test_step_errors_are_protocol_errors() -> None:
    head, tail = build_route("tiny-llama", (0, 3, 6), max_sessions=1, context_length=64)
    ids = head.tokenize(Prompt(text="hello"))
    with pytest.raises(SessionNotFoundError):
        head.step([StepInput("nope", 0, tokens=ids)])
    head.open_session("s", prompt_tokens=ids, sampling=GREEDY)
    tail.open_session("s", prompt_tokens=ids, sampling=GREEDY)
    with pytest.raises(CapacityError):
        head.open_session("t", prompt_tokens=ids, sampling=GREEDY)
    with pytest.raises(FrameError):
        head.step([StepInput("s", 3, tokens=ids)])  # wrong start position
    with pytest.raises(FrameError):
        head.step([StepInput("s", 0, hidden=np.zeros((1, 64), np.float32))])  # the head takes tokens
    with pytest.raises(FrameError):
        tail.step([StepInput("s", 0, hidden=np.zeros((len(ids), 65), np.float32))])  # wrong hidden size
    with pytest.raises(FrameError):
        tail.step([StepInput("s", 0, tokens=ids)])  # a non-head takes hidden states
    with pytest.raises(BadRequestError):
        head.step([StepInput("s", 0, tokens=[10_000])])
    with pytest.raises(ContextLengthError):
        head.step([StepInput("s", 0, tokens=[5] * 65)])
    with pytest.raises(ContextLengthError):
        tail.open_session("long", prompt_tokens=[5] * 64, sampling=GREEDY)
    with pytest.raises(BadRequestError):
        tail.tokenize(Prompt(text="only the head tokenizes"))
    # None of the rejected steps advanced the session: the real first chunk still goes through.
    hidden = head.step([StepInput("s", 0, tokens=ids)])[0].hidden
    assert tail.step([StepInput("s", 0, hidden=hidden, sample=True)])[0].token is not None


def test_load_backend_builds_a_torch_backend_that_satisfies_the_contract() -> None:
    backend = load_backend("torch", model="tiny-gemma3", layer_start=0, layer_end=6, context_length=128)
    assert isinstance(backend, Backend)
    info = backend.info
    assert (info.kind, info.n_layers, info.hidden_shape, info.context_length) == ("torch", 6, [64], 128)
    assert backend.is_head and backend.is_tail
    chat = backend.tokenize(Prompt(messages=[{"role": "user", "content": "hi"}]))
    assert bytes(b for t in chat for b in backend.token_bytes(t)) == b"<user>hi\n<assistant>"
    assert backend.is_end_of_generation(1) and not backend.is_end_of_generation(chat[-1])


# ---- issue #19: n > 1 forks, logprobs, constraints refused --------------------------------------------------------

def _choices(backends: list[TorchBackend], ids: list[int], n: int, sampling: SamplingParams,
             steps: int = 12) -> list[list[int | None]]:
    names = ["c0", *(f"c{i}" for i in range(1, n))]
    for b in reversed(backends):
        b.open_session("c0", prompt_tokens=ids, sampling=sampling)
    items = [StepInput("c0", 0, tokens=ids, sample=True, forks=tuple(names[1:]))]
    for b in backends:
        outs = b.step(items)
        items = [StepInput(i.session_id, i.start_position, hidden=o.hidden, sample=i.sample, forks=i.forks)
                 for i, o in zip(items, outs, strict=True)]
    picks: list[list[int | None]] = [[outs[0].token], *([f.token] for f in outs[0].forks)]
    while len(picks[0]) < steps:
        at = len(ids) + len(picks[0]) - 1
        items = [StepInput(name, at, tokens=[p[-1]], sample=True) for name, p in zip(names, picks, strict=True)]
        for b in backends:
            outs = b.step(items)
            items = [StepInput(i.session_id, i.start_position, hidden=o.hidden, sample=True)
                     for i, o in zip(items, outs, strict=True)]
        for p, o in zip(picks, outs, strict=True):
            p.append(o.token)
    for b in backends:
        for name in names:
            b.close_session(name)
    return picks


def test_forked_choices_equal_unforked_runs() -> None:
    route = WireRoute(build_route("tiny-llama", (0, 3, 6), max_sessions=4))
    ids = route.backends[0].tokenize(Prompt(text=LONG_PROMPT))
    greedy = route.generate(ids, 12)[1]
    assert _choices(route.backends, ids, 3, GREEDY) == [greedy] * 3
    hot = _choices(route.backends, ids, 3, SamplingParams(temperature=1.5, seed=11))
    assert len({tuple(c) for c in hot}) == 3
    # Sessions never share a forward pass here, so each choice is exactly the unforked run with seed + i.
    for i, choice in enumerate(hot):
        assert route.generate(ids, 12, sampling=SamplingParams(temperature=1.5, seed=11 + i))[1] == choice


def test_logprobs_are_the_reference_models_log_softmax() -> None:
    ref = reference("tiny-llama")
    (backend,) = build_route("tiny-llama", (0, 6))
    ids = backend.tokenize(Prompt(text=LONG_PROMPT))
    backend.open_session("s", prompt_tokens=ids, sampling=SamplingParams(temperature=0.0, logprobs=4))
    out = backend.step([StepInput("s", 0, tokens=ids, sample=True)])[0]
    with torch.no_grad():
        expected = torch.log_softmax(ref(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    lp = out.logprobs
    assert lp is not None and lp.token == out.token == int(expected.argmax())
    assert abs(lp.logprob - float(expected[out.token])) < 1e-4
    assert [c.token for c in lp.top] == [int(i) for i in torch.topk(expected, 4).indices]
    assert all(abs(c.logprob - float(expected[c.token])) < 1e-4 for c in lp.top)


def test_output_constraints_are_refused_naming_the_backend() -> None:
    from schemas.constraint import JsonObjectConstraint

    head, tail = build_route("tiny-llama", (0, 3, 6))
    ids = head.tokenize(Prompt(text="hello"))
    head.open_session("s", prompt_tokens=ids, sampling=SamplingParams(constraint=JsonObjectConstraint()))
    with pytest.raises(BadRequestError, match="torch backend does not enforce") as info:
        tail.open_session("s", prompt_tokens=ids, sampling=SamplingParams(constraint=JsonObjectConstraint()))
    assert info.value.param == "response_format"
