"""Tokenization for the torch backend: prompts to ids on the head, ids to exact bytes and end-of-turn on the tail.

Wraps a transformers (tokenizers-backed) tokenizer. ``token_bytes`` must give the bytes a token stands for in
isolation, so the node can assemble UTF-8 text across tokens: byte-level BPE maps its printable stand-in characters
back to bytes, sentencepiece pieces turn ``▁`` into a space and byte-fallback pieces ``<0xNN>`` into that raw byte.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from schemas.errors import BadRequestError
from schemas.session import Prompt

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
"""The Gemma turn format (the GGUF carries no template); a system message is folded into the first user turn."""

TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

TINY_SPECIALS = ("<pad>", "<eos>", "<bos>")
"""Ids 0, 1, 2 of the tiny byte-level vocabulary; the 256 bytes follow."""

_END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<turn|>")
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: every UTF-8 byte is one token, after ``<pad> <eos> <bos>``."""
    byte_chars = sorted(_unicode_to_byte(), key=lambda ch: _unicode_to_byte()[ch])
    vocab = {tok: i for i, tok in enumerate([*TINY_SPECIALS, *byte_chars])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def _decoder_types(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    decoder = tokenizer.backend_tokenizer.decoder
    # The decoder's own state, not the whole tokenizer's JSON (which takes seconds for a large vocabulary).
    spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    found: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        found.add(str(node.get("type")))
        for child in node.get("decoders") or []:
            walk(child)

    walk(spec)
    return found


class TokenCodec:
    """Prompt -> ids (head) and id -> bytes / end-of-generation (tail) for one tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, extra_eos: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self._byte_level = "ByteLevel" in _decoder_types(tokenizer)
        added = tokenizer.added_tokens_decoder  # built afresh on every access: read it once
        self._added = {i: str(tok.content) for i, tok in added.items()}
        self._special = set(tokenizer.all_special_ids) | {i for i, tok in added.items() if tok.special}
        eos = {tid for tid in extra_eos if tid is not None}
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        for name in _END_OF_TURN:
            tid = tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id:
                eos.add(tid)
        self.eos_ids = frozenset(eos)

    @classmethod
    def load(cls, directory: Path, extra_eos: list[int]) -> TokenCodec:
        return cls(AutoTokenizer.from_pretrained(str(directory)), extra_eos)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            text = self._render_chat(prompt.messages, prompt.add_generation_prompt)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif prompt.text is not None:
            ids = self.tokenizer(prompt.text, add_special_tokens=True)["input_ids"]
        else:
            raise BadRequestError("prompt has neither text nor messages")
        if not ids:
            raise BadRequestError("prompt tokenizes to nothing")
        return [int(i) for i in ids]

    @property
    def template_source(self) -> str | None:
        """The chat template ``tokenize`` renders with (a tokenizer with named templates renders its default)."""
        template: object = self.tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        return template if isinstance(template, str) else None

    def _render_chat(self, messages: list[dict[str, object]], add_generation_prompt: bool) -> str:
        if self.tokenizer.chat_template is None:
            raise BadRequestError("this model has no chat template: send a completion prompt instead")
        # Templates know system/user/assistant; developer is OpenAI's newer name for system.
        # An assistant turn's reasoning_content goes to the template too (it may render it as a think block, as
        # Qwen 3's does), as on llama.cpp heads.
        normalized = [{"role": "system" if m.get("role") == "developer" else str(m.get("role")),
                       "content": str(m.get("content") or ""),
                       **({"reasoning_content": str(m["reasoning_content"])} if m.get("reasoning_content") else {})}
                      for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(normalized, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja raises its own types for malformed messages
            raise BadRequestError(f"cannot apply the chat template: {exc}") from exc
        return str(text)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one codec per backend, lives as long as it)
    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < self.vocab_size or token in self._special:
            return b""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return b""
        if token in self._added:
            return self._added[token].encode()
        if self._byte_level:
            table = _unicode_to_byte()
            return bytes(table[ch] for ch in piece)
        match = _BYTE_PIECE.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode()

    def is_end_of_generation(self, token: int) -> bool:
        return token in self.eos_ids
