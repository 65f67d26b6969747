"""gateway.serving's token-chunk template: the spliced bytes must equal a full render for any text, and a full
render is the chunk model's own dump (the shape the official client parses)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway import sse
from gateway.replies import Kind, Replies
from gateway.serving import _ChunkTemplate
from schemas.openai import ChatChunkChoice, ChatCompletionChunk, ChatDelta, Completion, CompletionChoice

TEXTS = ["Paris", " the", "", '"quoted"', "back\\slash", "tab\tnew\nline", "é", "日本語", "🙂", "\x00\x1f\x7f",
         "\u2028", "</script>", "\x00swarmroute-token-text\x00"]


def model_chunk(kind: Kind, created: int, text: str) -> dict[str, Any]:
    if kind == "chat":
        return ChatCompletionChunk(id="x", model="m", created=created, choices=[
            ChatChunkChoice(delta=ChatDelta(content=text))]).model_dump(mode="json", exclude_none=True)
    return Completion(id="x", model="m", created=created, object="text_completion", choices=[
        CompletionChoice(text=text)]).model_dump(mode="json", exclude_none=True)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("text", TEXTS)
def test_template_render_equals_a_full_render(kind: Kind, text: str) -> None:
    replies = Replies(kind, n=1, logprobs=False, tool_format=None, cid="x", model="m")
    assert replies.plain
    template = _ChunkTemplate(replies)
    full = replies.chunk([replies.plain_choice(text, None)])
    assert full == model_chunk(kind, replies.created, text)
    assert template.render(text) == sse.data(full)
    body = json.loads(template.render(text).removeprefix(b"data: "))
    assert body["choices"][0].get("text", body["choices"][0].get("delta", {}).get("content")) == text
