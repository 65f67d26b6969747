"""A llama.cpp model's text side: prompts to token ids (chat messages through the template first), tokens to the
exact bytes they stand for, the end-of-generation tokens. Every node turns tokens into bytes; only the head renders
and tokenizes."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import llama_cpp

from actors.backends.llamacpp.chat_template import ChatTemplate, select_template
from schemas.errors import BackendError, BadRequestError
from schemas.reasoning import ReasoningStart, prompt_reasoning_start
from schemas.session import Prompt
from schemas.tools import ToolCallFormat, ToolSet

__all__ = ["Vocabulary"]


class Vocabulary:
    """Not locked: llama.cpp's vocabulary is read-only once the model is loaded."""

    def __init__(self, vocab: Any, *, model_name: str, architecture: str, chat_template: str | None,
                 with_template: bool) -> None:
        """``with_template``: render chat messages (the head); ``chat_template`` is the GGUF's own, if any."""
        self._vocab = vocab
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self._model_name = model_name
        self._architecture = architecture
        self._pieces: dict[int, bytes] = {}
        self.template: ChatTemplate | None = None
        if with_template:
            bos, eos = llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)
            self.template = select_template(chat_template, architecture, bos_token=self._text(bos),
                                            eos_token=self._text(eos))

    def _text(self, token: int) -> str:
        if token < 0:
            return ""
        text = llama_cpp.llama_vocab_get_text(self._vocab, token)
        return text.decode("utf-8", errors="replace") if text else ""

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            text = self._render(prompt.messages, prompt.add_generation_prompt, prompt.tools)
        elif prompt.tools is not None:
            raise BadRequestError("tools need chat messages", param="tools")
        elif prompt.text is not None:
            text = prompt.text
        else:
            raise BadRequestError("prompt has neither text nor messages")
        tokens = self._tokenize(text)
        if not tokens:
            raise BadRequestError("the prompt is empty")
        return tokens

    def tool_format(self) -> ToolCallFormat:
        """How this model is asked to write tool calls (``ChatTemplate.tool_format``)."""
        if self.template is None:
            raise BadRequestError(f"{self._model_name} has no chat template: no tools", param="tools")
        return self.template.tool_format

    def reasoning_start(self, prompt_tokens: list[int]) -> ReasoningStart | None:
        """Where a reply to this prompt starts relative to a think block (``schemas.reasoning``); ``None`` without
        a template that marks reasoning."""
        if self.template is None:
            return None
        return prompt_reasoning_start(self.template.source, prompt_tokens,
                                      lambda t: self.token_bytes(t) if 0 <= t < self.n_vocab else b"")

    def _render(self, messages: Sequence[dict[str, object]], add_generation_prompt: bool,
                tools: ToolSet | None = None) -> str:
        if self.template is None:
            raise BadRequestError(f"{self._model_name} has no chat template and no known fallback for "
                                  f"architecture {self._architecture!r}; use the completions endpoint")
        text = self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        # Templates write BOS themselves; tokenizing adds it again when the vocabulary wants one, so drop the
        # written one rather than send it twice (llama.cpp's server does the same).
        bos = self.template.bos_token
        if bos and text.startswith(bos) and llama_cpp.llama_vocab_get_add_bos(self._vocab):
            text = text[len(bos):]
        return text

    def _tokenize(self, text: str) -> list[int]:
        raw = text.encode("utf-8")
        room = len(raw) + 8
        buf = (llama_cpp.llama_token * room)()
        n = llama_cpp.llama_tokenize(self._vocab, raw, len(raw), buf, room, True, True)
        if n < 0:
            room = -n
            buf = (llama_cpp.llama_token * room)()
            n = llama_cpp.llama_tokenize(self._vocab, raw, len(raw), buf, room, True, True)
        if n < 0:
            raise BackendError(f"llama.cpp failed to tokenize a {len(raw)}-byte prompt")
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token)
        return piece

    def _piece(self, token: int) -> bytes:
        if not 0 <= token < self.n_vocab:
            raise BadRequestError(f"token {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        # special=False: control tokens render as nothing, as in llama.cpp's server and llama-cpp-python output.
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, size, 0, False)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))
