"""Chat messages -> prompt text: the GGUF's own Jinja template, else the model family's known format.

A GGUF normally carries its Hugging Face chat template in ``tokenizer.chat_template``; it is rendered the way
Transformers and llama-cpp-python render it (sandboxed Jinja2, ``trim_blocks``/``lstrip_blocks``, ``bos_token``,
``eos_token``, ``raise_exception``, ``strftime_now``). Some conversions drop it (the bundled Gemma 3 270M has
none); for those the family's official template stands in, chosen by ``general.architecture``.

Tools (issue #19): a template that renders ``tools`` and ``<tool_call>`` blocks gets them natively (``hermes``);
every other template gets the generic fallback of ``actors/backends/llamacpp/tool_prompt.py`` (``generic``). Which one a
template uses is ``ChatTemplate.tool_format``; the head reports it to the gateway, which constrains and parses
replies in that format.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from actors.backends.llamacpp.tool_prompt import generic_messages, native_messages, tool_dicts
from schemas.errors import BadRequestError
from schemas.tools import HERMES_OPEN, ToolCallFormat, ToolSet

GEMMA_TEMPLATE = (
    # Google's Gemma 3 instruction template (text parts only): no system role, so a system message becomes the
    # prefix of the first user turn; "assistant" is called "model".
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

FAMILY_TEMPLATES: Mapping[str, str] = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE}
"""Fallbacks by ``general.architecture`` for GGUFs without ``tokenizer.chat_template``."""

_ROLE_ALIASES = {"developer": "system"}


def _raise(message: str) -> None:
    raise BadRequestError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Transformers' tojson: non-ASCII kept as is (Jinja's builtin escapes it and HTML-escapes quotes).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A compiled template plus the special-token texts it may reference."""

    source: str
    origin: str
    """``gguf`` or ``fallback:<architecture>``: shown in diagnostics."""
    bos_token: str = ""
    eos_token: str = ""
    _compiled: jinja2.Template = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise BadRequestError(f"chat template ({self.origin}) does not compile: {e}") from e
        object.__setattr__(self, "_compiled", compiled)

    @property
    def tool_format(self) -> ToolCallFormat:
        """``hermes`` when the template renders ``tools`` and writes ``<tool_call>`` blocks itself (read from its
        source, as llama.cpp's server detects template capabilities), else ``generic``."""
        return "hermes" if "tools" in self.source and HERMES_OPEN in self.source else "generic"

    def render(self, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True,
               tools: ToolSet | None = None) -> str:
        """The prompt text, BOS text included when the template writes it. Raises ``BadRequestError``.

        ``tools``, and tool calls and results in the history, are rendered in ``tool_format``."""
        normalized = [_normalize(m) for m in messages]
        if not normalized:
            raise BadRequestError("messages must not be empty")
        extra: dict[str, object] = {}
        if self.tool_format == "hermes":
            normalized = native_messages(normalized)
            if tools is not None:
                extra["tools"] = tool_dicts(tools)
        else:
            normalized = generic_messages(normalized, tools, parallel=tools.parallel if tools else True)
        try:
            return self._compiled.render(messages=normalized, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except BadRequestError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, ValueError) as e:
            raise BadRequestError(f"chat template ({self.origin}) failed on these messages: {e}") from e


def _normalize(message: Mapping[str, object]) -> dict[str, object]:
    """``{"role", "content": str}``: text parts joined, ``developer`` read as ``system``; other keys kept."""
    role = message.get("role")
    if not isinstance(role, str):
        raise BadRequestError("every message needs a string 'role'")
    out = dict(message)
    out["role"] = _ROLE_ALIASES.get(role, role)
    out["content"] = _text(message.get("content"))
    return out


def _text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise BadRequestError(f"only text content parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequestError(f"message content must be a string or a list of text parts, not {type(content).__name__}")


def select_template(gguf_template: str | None, architecture: str, *, bos_token: str = "",
                    eos_token: str = "") -> ChatTemplate | None:
    """The GGUF's template if it has one, else the family fallback for ``architecture``, else ``None``."""
    if gguf_template:
        return ChatTemplate(gguf_template, "gguf", bos_token, eos_token)
    fallback = FAMILY_TEMPLATES.get(architecture)
    if fallback is None:
        return None
    return ChatTemplate(fallback, f"fallback:{architecture}", bos_token, eos_token)
