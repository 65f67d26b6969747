"""Token logprobs (``TokenEvent.logprobs``, bytes resolved by the head) in the shapes OpenAI's APIs return.

``token`` is the token's text when its bytes are complete UTF-8; a token that is a fragment of a character (byte
tokens) is written ``bytes:\\xNN...``, OpenAI's convention, and ``bytes`` is always exact, so a client can rebuild
the text by concatenating bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.openai import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from schemas.openai_responses import ResponseLogprob, ResponseTopLogprob
from schemas.session import TokenLogprobs


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _raw(values: list[int] | None) -> bytes:
    return bytes(values or [])


def chat_entry(lp: TokenLogprobs) -> TokenLogprob:
    """One ``choices[].logprobs.content`` entry."""
    return TokenLogprob(token=token_text(_raw(lp.bytes)), logprob=lp.logprob, bytes=list(lp.bytes or []),
                        top_logprobs=[TopLogprob(token=token_text(_raw(c.bytes)), logprob=c.logprob,
                                                 bytes=list(c.bytes or [])) for c in lp.top])


def chat_logprobs(entries: Sequence[TokenLogprobs]) -> ChoiceLogprobs:
    """A chat choice's (or a stream chunk's) ``logprobs``."""
    return ChoiceLogprobs(content=[chat_entry(lp) for lp in entries])


def completion_logprobs(entries: Sequence[TokenLogprobs], text_offset: int = 0) -> CompletionLogprobs:
    """A completion choice's ``logprobs`` (tokens, token_logprobs, top_logprobs keyed by text, text_offset), built
    as llama-cpp-python builds it: the top entries, then the sampled token's own. ``text_offset`` is where the
    first token's text starts in the choice's text (the prompt's length when echoing)."""
    out = CompletionLogprobs()
    offset = text_offset
    for lp in entries:
        text = _raw(lp.bytes).decode("utf-8", errors="ignore")
        out.tokens.append(token_text(_raw(lp.bytes)))
        out.token_logprobs.append(lp.logprob)
        top = {token_text(_raw(c.bytes)): c.logprob for c in lp.top}
        top[token_text(_raw(lp.bytes))] = lp.logprob
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def responses_logprobs(entries: Sequence[TokenLogprobs]) -> list[ResponseLogprob]:
    """The Responses API's ``logprobs`` of an output text (and of its ``output_text.delta`` events)."""
    return [ResponseLogprob(token=token_text(_raw(lp.bytes)), logprob=lp.logprob, bytes=list(lp.bytes or []),
                            top_logprobs=[ResponseTopLogprob(token=token_text(_raw(c.bytes)), logprob=c.logprob,
                                                             bytes=list(c.bytes or [])) for c in lp.top])
            for lp in entries]
