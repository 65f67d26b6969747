"""gateway.logprobs: the tail's logprobs, resolved to bytes by the head (``TokenLogprobs.with_bytes``), in OpenAI's
shapes: chat ``logprobs.content`` read back by the official SDK, and completions logprobs equal to what
llama-cpp-python's own ``create_completion(logprobs=N)`` returns for the same greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.responses.response_output_text import Logprob as SDKResponseLogprob

from gateway.logprobs import chat_logprobs, completion_logprobs, responses_logprobs, token_text
from schemas.session import LogprobCandidate, TokenLogprobs

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backend import StepInput  # noqa: E402
from actors.backends import load_backend  # noqa: E402
from actors.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from schemas.session import Prompt, SamplingParams  # noqa: E402

PROMPT = "The capital of France is"
N = 12


def test_token_text_is_the_text_or_the_bytes_of_a_fragment() -> None:
    assert token_text(b" Paris") == " Paris" and token_text("é".encode()) == "é"
    assert token_text(b"\xe2\x80") == "bytes:\\xe2\\x80"
    assert token_text(b"") == ""


def test_shapes_without_a_model() -> None:
    lp = TokenLogprobs(token=7, logprob=-0.5, bytes=list(b"ab"), top=[
        LogprobCandidate(token=7, logprob=-0.5, bytes=list(b"ab")), LogprobCandidate(token=9, logprob=-1.5,
                                                                                       bytes=[0xF0, 0x9F])])
    entry = chat_logprobs([lp]).content[0]  # type: ignore[index]
    assert ChatCompletionTokenLogprob.model_validate(entry.model_dump()).top_logprobs[1].token == "bytes:\\xf0\\x9f"
    resp = responses_logprobs([lp])[0]
    assert SDKResponseLogprob.model_validate(resp.model_dump()).top_logprobs[0].token == "ab"
    legacy = completion_logprobs([lp, lp], text_offset=10)
    assert legacy.tokens == ["ab", "ab"] and legacy.text_offset == [10, 12]
    assert legacy.top_logprobs[0] == {"ab": -0.5, "bytes:\\xf0\\x9f": -1.5}


@pytest.fixture(scope="module")
def backend(gemma_path: Path) -> Iterator[LlamaCppBackend]:
    b = load_backend("llamacpp", model_path=gemma_path, n_ctx=512, max_sessions=1, threads=2)
    assert isinstance(b, LlamaCppBackend)
    yield b
    b.close()


def resolved_run(backend: LlamaCppBackend, tokens: list[int], n_top: int) -> list[TokenLogprobs]:
    """Greedy tokens with logprobs, each resolved as the head resolves them."""
    backend.open_session("r", prompt_tokens=tokens, sampling=SamplingParams(temperature=0.0, logprobs=n_top))
    try:
        item = StepInput("r", 0, tokens=tokens, sample=True)
        out = []
        for i in range(N):
            o = backend.step([item])[0]
            assert o.token is not None and o.logprobs is not None
            out.append(o.logprobs.with_bytes(backend.token_bytes))
            item = StepInput("r", len(tokens) + i, tokens=[o.token], sample=True)
        return out
    finally:
        backend.close_session("r")


@pytest.mark.slow
def test_completion_logprobs_equal_llama_cpp_python(backend: LlamaCppBackend, gemma_path: Path) -> None:
    llm = llama_cpp.Llama(str(gemma_path), n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=True,
                          verbose=False)
    try:
        ref = llm.create_completion(PROMPT, max_tokens=N, temperature=0.0, logprobs=3)["choices"][0]["logprobs"]
    finally:
        llm.close()
    ours = completion_logprobs(resolved_run(backend, backend.tokenize(Prompt(text=PROMPT)), 3),
                               text_offset=len(PROMPT))
    n = len(ref["tokens"])
    assert n >= 8
    assert ours.tokens[:n] == ref["tokens"] and ours.text_offset[:n] == ref["text_offset"]
    for mine, theirs in zip(ours.token_logprobs[:n], ref["token_logprobs"], strict=True):
        assert mine is not None and abs(mine - theirs) < 1e-4
    for mine_top, theirs_top in zip(ours.top_logprobs[:n], ref["top_logprobs"], strict=True):
        assert mine_top is not None and mine_top.keys() == theirs_top.keys()
        assert all(abs(mine_top[k] - theirs_top[k]) < 1e-4 for k in mine_top)


@pytest.mark.slow
def test_chat_logprobs_carry_exact_bytes_and_parse_with_the_sdk(backend: LlamaCppBackend) -> None:
    text = "Grüße aus 日本: "
    resolved = resolved_run(backend, backend.tokenize(Prompt(text=text)), 2)
    content = chat_logprobs(resolved).content
    assert content is not None
    for entry, lp in zip(content, resolved, strict=True):
        sdk = ChatCompletionTokenLogprob.model_validate(entry.model_dump())
        assert sdk.bytes == list(backend.token_bytes(lp.token)) and sdk.logprob == lp.logprob
        assert [t.bytes for t in sdk.top_logprobs] == [list(backend.token_bytes(c.token)) for c in lp.top]
    # Concatenated bytes are the generated text exactly, whatever the tokens' own decodability.
    generated = b"".join(bytes(e.bytes or []) for e in content)
    assert generated == b"".join(backend.token_bytes(lp.token) for lp in resolved)
