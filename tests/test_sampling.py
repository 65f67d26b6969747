"""Per-session llama.cpp sampler chains, driven through the real backend and checked against numpy references;
logprobs against llama-cpp-python's own; grammar constraints (JSON Schema, JSON object) on the real model's output."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backend import StepInput  # noqa: E402
from actors.backends import load_backend  # noqa: E402
from actors.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from actors.backends.llamacpp.grammar import grammar_for  # noqa: E402
from schemas.constraint import GrammarConstraint, JsonObjectConstraint, JsonSchemaConstraint  # noqa: E402
from schemas.session import Prompt, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

N = 16
PROMPT = "Write a short poem about the sea. The sea"


@pytest.fixture(scope="module")
def backend(gemma_path: Path) -> Iterator[LlamaCppBackend]:
    b = load_backend("llamacpp", model_path=gemma_path, n_ctx=512, max_sessions=2, threads=2)
    assert isinstance(b, LlamaCppBackend)
    yield b
    b.close()


def sample_run(backend: LlamaCppBackend, tokens: list[int], sampling: SamplingParams,
               forced: list[int] | None = None) -> tuple[list[int], list[np.ndarray]]:
    """``N`` picks (fed back, or ``forced`` tokens fed instead) and the raw logits each pick was drawn from."""
    backend.open_session("s", prompt_tokens=tokens, sampling=sampling)
    try:
        item = StepInput("s", 0, tokens=tokens, sample=True)
        picks, logits = [], []
        for i in range(N):
            out = backend.step([item])[0]
            assert out.token is not None
            picks.append(out.token)
            logits.append(backend.last_logits("s"))
            fed = forced[i] if forced is not None else out.token
            item = StepInput("s", len(tokens) + i, tokens=[fed], sample=True)
        return picks, logits
    finally:
        backend.close_session("s")


def test_seeded_sampling_is_reproducible(backend: LlamaCppBackend) -> None:
    tokens = backend.tokenize(Prompt(text=PROMPT))
    hot = {"temperature": 1.2, "top_k": 0, "top_p": 1.0}
    first, _ = sample_run(backend, tokens, SamplingParams(seed=1234, **hot))
    again, _ = sample_run(backend, tokens, SamplingParams(seed=1234, **hot))
    assert first == again
    others = [sample_run(backend, tokens, SamplingParams(seed=s, **hot))[0] for s in (1, 2)]
    assert any(o != first for o in others)
    greedy, _ = sample_run(backend, tokens, SamplingParams(temperature=0.0))
    assert first != greedy  # a hot sampler really sampled


def test_temperature_zero_is_argmax(backend: LlamaCppBackend) -> None:
    tokens = backend.tokenize(Prompt(text=PROMPT))
    picks, logits = sample_run(backend, tokens, SamplingParams(temperature=0.0))
    assert picks == [int(row.argmax()) for row in logits]


@pytest.mark.parametrize("truncation", [{"top_k": 1}, {"top_p": 0.0001}, {"min_p": 0.9999}],
                         ids=["top_k", "top_p", "min_p"])
def test_truncation_to_one_candidate_is_greedy_even_when_hot(backend: LlamaCppBackend,
                                                             truncation: dict[str, float]) -> None:
    tokens = backend.tokenize(Prompt(text=PROMPT))
    greedy, _ = sample_run(backend, tokens, SamplingParams(temperature=0.0))
    picks, _ = sample_run(backend, tokens, SamplingParams(temperature=2.0, seed=7, **truncation))  # type: ignore[arg-type]
    assert picks == greedy
    untruncated, _ = sample_run(backend, tokens, SamplingParams(temperature=2.0, seed=7))
    assert untruncated != greedy  # the truncation, not luck, made it greedy


def penalized(logits: np.ndarray, window: list[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's penalty sampler (llama-sampling.cpp) in numpy."""
    out = logits.astype(np.float64).copy()
    ids, counts = np.unique(np.asarray(window[-p.penalty_last_n:]), return_counts=True)
    x = out[ids]
    x = np.where(x <= 0, x * p.repeat_penalty, x / p.repeat_penalty)
    out[ids] = x - counts * p.frequency_penalty - p.presence_penalty
    return out


def test_penalties_see_the_prompt_and_the_generated_tokens(backend: LlamaCppBackend) -> None:
    tokens = backend.tokenize(Prompt(text="one two one two one two one two one two one two one"))
    params = SamplingParams(temperature=0.0, repeat_penalty=1.8, frequency_penalty=0.4, presence_penalty=0.3,
                            penalty_last_n=12)
    picks, raw = sample_run(backend, tokens, params)
    greedy, _ = sample_run(backend, tokens, SamplingParams(temperature=0.0))
    history = list(tokens)
    for pick, logits in zip(picks, raw, strict=True):
        assert pick == int(penalized(logits, history, params).argmax())
        history.append(pick)
    # Without penalties the model just repeats the prompt's pattern; the penalties (fed the prompt) break it.
    assert greedy[0] in tokens[-params.penalty_last_n:]
    assert picks[0] != greedy[0]


# ---- logprobs (issue #19) ----------------------------------------------------------------------------------------

LOGPROB_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def reference(gemma_path: Path) -> Iterator[llama_cpp.Llama]:
    # logits_all: llama-cpp-python computes logprobs only with every row's logits kept.
    llm = llama_cpp.Llama(str(gemma_path), n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=True,
                          verbose=False)
    yield llm
    llm.close()


def text_of(backend: LlamaCppBackend, token: int) -> str:
    # llama-cpp-python keys top_logprobs by each token's text, decoded with errors="ignore".
    return backend.token_bytes(token).decode("utf-8", errors="ignore")


def with_logprobs(backend: LlamaCppBackend, tokens: list[int], sampling: SamplingParams, n: int = N,
                  ) -> list[tuple[int, object]]:
    backend.open_session("lp", prompt_tokens=tokens, sampling=sampling)
    try:
        item = StepInput("lp", 0, tokens=tokens, sample=True)
        out = []
        for i in range(n):
            o = backend.step([item])[0]
            assert o.token is not None
            out.append((o.token, o.logprobs))
            item = StepInput("lp", len(tokens) + i, tokens=[o.token], sample=True)
        return out
    finally:
        backend.close_session("lp")


@pytest.mark.parametrize("text", LOGPROB_PROMPTS)
def test_logprobs_equal_llama_cpp_python(backend: LlamaCppBackend, reference: llama_cpp.Llama, text: str) -> None:
    reference.reset()  # a fresh prompt: no KV reuse from the previous call (see test_llamacpp.reference_greedy)
    ref = reference.create_completion(text, max_tokens=N, temperature=0.0, logprobs=5)["choices"][0]["logprobs"]
    assert ref is not None and len(ref["tokens"]) >= 8  # it may stop at EOS before N
    tokens = backend.tokenize(Prompt(text=text))
    ours = with_logprobs(backend, tokens, SamplingParams(temperature=0.0, logprobs=5), n=len(ref["tokens"]))
    for i, (token, lp) in enumerate(ours):
        assert lp is not None and lp.token == token
        assert text_of(backend, token) == ref["tokens"][i]
        assert abs(lp.logprob - ref["token_logprobs"][i]) < 1e-4
        assert len(lp.top) == 5 and [c.logprob for c in lp.top] == sorted((c.logprob for c in lp.top), reverse=True)
        assert lp.top[0].token == token  # greedy picks the most likely token
        # Built as llama-cpp-python builds it: the top 5 by text, then the sampled token's own entry.
        mine = {text_of(backend, c.token): c.logprob for c in lp.top}
        mine[text_of(backend, token)] = lp.logprob
        theirs = ref["top_logprobs"][i]
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[k] - theirs[k]) < 1e-4 for k in mine)


def test_logprobs_are_off_unless_asked_and_token_only_at_zero(backend: LlamaCppBackend) -> None:
    tokens = backend.tokenize(Prompt(text=LOGPROB_PROMPTS[0]))
    off = with_logprobs(backend, tokens, SamplingParams(temperature=0.0), n=4)
    only = with_logprobs(backend, tokens, SamplingParams(temperature=0.0, logprobs=0), n=4)
    top20 = with_logprobs(backend, tokens, SamplingParams(temperature=0.0, logprobs=20), n=4)
    assert all(lp is None for _, lp in off)
    assert [t for t, _ in only] == [t for t, _ in off] == [t for t, _ in top20]  # logprobs never change the pick
    for (_, a), (_, b) in zip(only, top20, strict=True):
        assert a is not None and b is not None and a.top == [] and len(b.top) == 20
        assert a.logprob == b.logprob and b.top[0].logprob == a.logprob


def test_logprobs_of_a_hot_sampler_are_the_raw_distributions(backend: LlamaCppBackend) -> None:
    # Temperature and penalties change what is picked, not the reported distribution (raw logits, like
    # llama-cpp-python and vLLM's default): the picked token's logprob is its entry in the raw log-softmax.
    tokens = backend.tokenize(Prompt(text=PROMPT))
    params = SamplingParams(temperature=1.5, seed=3, repeat_penalty=1.3, logprobs=3)
    picks, raw = sample_run(backend, tokens, params)
    again = with_logprobs(backend, tokens, params)
    assert [t for t, _ in again] == picks
    for (token, lp), logits in zip(again, raw, strict=True):
        x = logits.astype(np.float64)
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert lp is not None and abs(lp.logprob - ref[token]) < 1e-4
        assert [c.token for c in lp.top] == [int(i) for i in np.argsort(-ref, kind="stable")[:3]]
    assert any(t != int(lg.argmax()) for t, lg in zip(picks, raw, strict=True))  # it really sampled


# ---- grammar constraints (issue #19) -----------------------------------------------------------------------------

SCHEMAS: dict[str, dict[str, object]] = {
    "enum-and-boolean": {
        "type": "object", "required": ["color", "ok"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
    "nested-objects-and-arrays": {
        "type": "object", "required": ["user", "items"],
        "properties": {
            "user": {"type": "object", "required": ["id", "email"],
                     "properties": {"id": {"type": "integer"}, "email": {"type": "string", "maxLength": 40}}},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "required": ["sku", "qty"],
                "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}}}}}},
    "required-and-optional-with-refs": {
        "type": "object", "required": ["name", "tags"], "$defs": {"tag": {"enum": ["a", "b", "c"]}},
        "properties": {"name": {"type": "string", "maxLength": 30}, "nickname": {"type": "string", "maxLength": 20},
                       "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 4},
                       "score": {"type": "number"}}},
    "array-root": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "string", "maxLength": 16}},
}
MAX_JSON_TOKENS = 160


def chat_tokens(backend: LlamaCppBackend, text: str) -> list[int]:
    return backend.tokenize(Prompt(messages=[{"role": "user", "content": text}]))


def generate_text(backend: LlamaCppBackend, tokens: list[int], sampling: SamplingParams,
                  limit: int = MAX_JSON_TOKENS) -> tuple[str, bool]:
    """The reply's text, and whether it ended by itself (end of generation) rather than at ``limit``."""
    backend.open_session("g", prompt_tokens=tokens, sampling=sampling)
    try:
        item = StepInput("g", 0, tokens=tokens, sample=True)
        out: list[int] = []
        for i in range(limit):
            token = backend.step([item])[0].token
            assert token is not None
            if backend.is_end_of_generation(token):
                return b"".join(backend.token_bytes(t) for t in out).decode(), True
            out.append(token)
            item = StepInput("g", len(tokens) + i, tokens=[token], sample=True)
        return b"".join(backend.token_bytes(t) for t in out).decode(errors="replace"), False
    finally:
        backend.close_session("g")


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_parses_and_validates(backend: LlamaCppBackend, name: str) -> None:
    schema = SCHEMAS[name]
    tokens = chat_tokens(backend, "Describe a customer order as JSON.")
    text, ended = generate_text(backend, tokens, SamplingParams(
        temperature=0.0, constraint=JsonSchemaConstraint(json_schema=schema)))
    assert ended, f"no end of generation within {MAX_JSON_TOKENS} tokens: {text!r}"
    jsonschema.validate(json.loads(text), schema)
    # The grammar did it: the same prompt without it is not JSON at all (a pretrained model, no chat tuning).
    free, _ = generate_text(backend, tokens, SamplingParams(temperature=0.0), limit=40)
    assert not parses(free)


def test_json_schema_holds_when_sampling_hot(backend: LlamaCppBackend) -> None:
    schema = SCHEMAS["nested-objects-and-arrays"]
    tokens = chat_tokens(backend, "Describe a customer order as JSON.")
    texts = []
    for seed in (1, 2, 3):
        text, ended = generate_text(backend, tokens, SamplingParams(
            temperature=1.0, seed=seed, constraint=JsonSchemaConstraint(json_schema=schema)), limit=300)
        assert ended, text
        jsonschema.validate(json.loads(text), schema)
        texts.append(text)
    assert len(set(texts)) > 1  # really sampled


def test_json_object_mode_parses(backend: LlamaCppBackend) -> None:
    tokens = chat_tokens(backend, 'Reply with a JSON object like {"city": "Paris"}.')
    text, ended = generate_text(backend, tokens, SamplingParams(temperature=0.0, constraint=JsonObjectConstraint()))
    assert ended, text
    assert isinstance(json.loads(text), dict)


def test_greedy_under_a_grammar_is_the_best_allowed_token(backend: LlamaCppBackend) -> None:
    # The shortlist shortcut must pick what applying the grammar to the whole vocabulary picks: at every step, the
    # highest raw logit among the tokens the grammar allows. The reference is a separate llama.cpp grammar sampler
    # applied to the full candidate array, fed the same picks.
    schema = SCHEMAS["nested-objects-and-arrays"]
    tokens = chat_tokens(backend, "Describe a customer order as JSON.")
    constraint = JsonSchemaConstraint(json_schema=schema)
    picks, raw = sample_run(backend, tokens, SamplingParams(temperature=0.0, constraint=constraint))
    vocab = llama_cpp.llama_model_get_vocab(backend._model)  # noqa: SLF001 - the test needs the raw vocabulary
    grammar = llama_cpp.llama_sampler_init_grammar(vocab, grammar_for(constraint).text.encode(), b"root")
    n_vocab = len(raw[0])
    data = (llama_cpp.llama_token_data * n_vocab)()
    view = np.frombuffer(data, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
    try:
        for pick, logits in zip(picks, raw, strict=True):
            view["id"], view["logit"], view["p"] = np.arange(n_vocab), logits, 0.0
            arr = llama_cpp.llama_token_data_array(data, n_vocab, -1, False)
            llama_cpp.llama_sampler_apply(grammar, ctypes.byref(arr))
            assert pick == int(view["logit"].argmax())
            llama_cpp.llama_sampler_accept(grammar, pick)
    finally:
        llama_cpp.llama_sampler_free(grammar)
    assert any(t != int(lg.argmax()) for t, lg in zip(picks, raw, strict=True))  # the grammar changed picks


def test_hot_sampling_under_a_grammar_draws_from_the_restricted_distribution(backend: LlamaCppBackend) -> None:
    # Plain temperature sampling under a grammar draws by rejection (Sampler._draw_constrained): its first tokens,
    # over many seeds, must follow softmax(logits / T) restricted to what the grammar allows, computed here from the
    # raw logits and a separate llama.cpp grammar sampler applied to the whole vocabulary.
    from actors.backends.llamacpp.sampling import Sampler

    constraint = GrammarConstraint(grammar='root ::= ("Red" | "Green" | "Blue" | "Yellow" | "red" | "green" | "blue" '
                                           '| "yellow" | "The colour is " [a-z]+)')
    temperature, draws = 1.5, 400
    tokens = chat_tokens(backend, "Name a colour.")
    backend.open_session("d", prompt_tokens=tokens, sampling=SamplingParams(temperature=0.0))
    try:
        backend.step([StepInput("d", 0, tokens=tokens, sample=True)])
        logits = backend.last_logits("d")
        ctx, row = backend._ctx, backend._sessions["d"].sampled_row  # noqa: SLF001 - sample the same row again
        vocab = llama_cpp.llama_model_get_vocab(backend._model)  # noqa: SLF001
        picks = []
        for seed in range(draws):
            sampler = Sampler(SamplingParams(temperature=temperature, seed=seed, constraint=constraint),
                              n_vocab=len(logits), vocab=vocab)
            try:
                picks.append(sampler.sample(ctx, row)[0])
            finally:
                sampler.close()
    finally:
        backend.close_session("d")
    grammar = llama_cpp.llama_sampler_init_grammar(vocab, grammar_for(constraint).text.encode(), b"root")
    data = (llama_cpp.llama_token_data * len(logits))()
    view = np.frombuffer(data, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
    view["id"], view["logit"], view["p"] = np.arange(len(logits)), logits, 0.0
    llama_cpp.llama_sampler_apply(grammar, ctypes.byref(llama_cpp.llama_token_data_array(data, len(logits), -1,
                                                                                          False)))
    llama_cpp.llama_sampler_free(grammar)
    allowed = np.isfinite(view["logit"])
    z = np.where(allowed, logits.astype(np.float64) / temperature, -np.inf)
    expected = np.exp(z - z.max())
    expected /= expected.sum()
    assert all(allowed[t] for t in picks)  # never a forbidden token
    likely = [int(t) for t in np.argsort(-expected)[:3]]
    assert expected[likely[0]] < 0.9  # a real choice, not a forced token
    for t in likely:  # each frequency within 4.5 standard deviations of its probability
        p = expected[t]
        assert abs(picks.count(t) / draws - p) < 4.5 * np.sqrt(p * (1 - p) / draws) + 1e-9, (t, p)
