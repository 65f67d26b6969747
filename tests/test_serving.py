"""gateway.serving's token-chunk template: the spliced bytes must equal a full render for any text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway import sse
from gateway.serving import _ChunkTemplate
from schemas.openai import ChatChunkChoice, ChatCompletionChunk, ChatDelta, Completion, CompletionChoice

TEXTS = ["Paris", " the", "", '"quoted"', "back\\slash", "tab\tnew\nline", "é", "日本語", "🙂", "\x00\x1f\x7f",
         "\u2028", "</script>", "\x00swarmroute-token-text\x00"]


def chat_chunk(text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
    delta = ChatDelta(role="assistant", content="") if first else ChatDelta(content=text)
    return ChatCompletionChunk(id="chatcmpl-x", model="m", choices=[
        ChatChunkChoice(delta=delta, finish_reason=finish)]).model_dump(mode="json", exclude_none=True)


def completion_chunk(text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
    return Completion(id="cmpl-x", model="m", object="text_completion", choices=[
        CompletionChoice(text=text or "", finish_reason=finish)]).model_dump(mode="json", exclude_none=True)


@pytest.mark.parametrize("make_chunk", [chat_chunk, completion_chunk])
@pytest.mark.parametrize("text", TEXTS)
def test_template_render_equals_a_full_render(make_chunk: Any, text: str) -> None:
    template = _ChunkTemplate(make_chunk)
    assert template.render(text) == sse.data(make_chunk(text, None, False))
    body = json.loads(template.render(text).removeprefix(b"data: "))
    assert body["choices"][0].get("text", body["choices"][0].get("delta", {}).get("content")) == text
