"""Reasoning marked in a model's reply (issue #27): the think markers, llama-server's ``reasoning_format`` choices,
and where a reply starts relative to a think block.

The head knows the chat template and the prompt it rendered; the gateway only sees the reply's text. The head tells
the gateway (``SessionOpened.reasoning``) whether the template marks reasoning and whether the prompt already opened
a think block (DeepSeek-R1 distills end their generation prompt with ``<think>\\n``); the gateway then splits the
reply's text into reasoning and answer (``gateway.reasoning``). Both sides read the markers from here, since
neither may import the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

ReasoningFormat = Literal["none", "auto", "deepseek", "deepseek-legacy"]
"""llama-server's ``reasoning_format`` (common/common.h, tools/server/README.md):

* ``none``: the reply is left unparsed, think tags and all, in ``content``;
* ``deepseek``: the reasoning goes to ``reasoning_content`` (``delta.reasoning_content`` when streamed), the tags
  are dropped from ``content``;
* ``deepseek-legacy``: ``content`` keeps the ``<think>`` block inline and a whole reply also has
  ``reasoning_content``; a stream leaves it inline (``content`` only);
* ``auto``: as ``deepseek`` (llama-server's default, and swarmroute's).
"""

REASONING_FORMATS: tuple[ReasoningFormat, ...] = ("none", "auto", "deepseek", "deepseek-legacy")

ReasoningStart = Literal["open", "closed"]
"""Where a reply to this prompt starts, for a template that marks reasoning: ``open`` inside a think block the
prompt opened (the reply's reasoning ends at ``</think>``), ``closed`` outside one (the reply may open one with
``<think>`` first). A template without think markers has none: its replies are plain text."""

PROMPT_TAIL_CHARS = 64
"""How much of the prompt's end the head looks at for an opened think block."""

PROMPT_TAIL_TOKENS = 16
"""How many of the prompt's last tokens the head decodes to find that end (a token is at least a byte)."""


def marks_reasoning(template_source: str) -> bool:
    """Whether a chat template writes think blocks (read from its source, as llama.cpp detects template
    capabilities): both markers appear in it."""
    return THINK_OPEN in template_source and THINK_CLOSE in template_source


def reasoning_start(template_source: str | None, prompt_tail: str) -> ReasoningStart | None:
    """Where the reply to a prompt ending with ``prompt_tail`` starts; ``None`` for a template without think
    markers (or none at all)."""
    if template_source is None or not marks_reasoning(template_source):
        return None
    opened = prompt_tail.rfind(THINK_OPEN)
    if opened >= 0 and THINK_CLOSE not in prompt_tail[opened:] and not prompt_tail[opened + len(THINK_OPEN):].strip():
        return "open"
    return "closed"


def prompt_reasoning_start(template_source: str | None, prompt_tokens: Sequence[int],
                           token_bytes: Callable[[int], bytes]) -> ReasoningStart | None:
    """``reasoning_start`` for a tokenized prompt: its last tokens' text, as the backend's ``token_bytes`` spells
    them (every backend's head reads it this way, whatever its tokenizer)."""
    if template_source is None or not marks_reasoning(template_source):
        return None
    tail = b"".join(token_bytes(t) for t in prompt_tokens[-PROMPT_TAIL_TOKENS:])
    return reasoning_start(template_source, tail.decode("utf-8", errors="replace")[-PROMPT_TAIL_CHARS:])
