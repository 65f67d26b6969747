"""Function tools as they travel between the gateway, the head (which renders them into the prompt) and the tail
(which constrains the reply to a call): the function specs, the caller's choice, and the text format of a call.

The format is the contract between the prompt the head renders and the parser in the gateway; both sides read its
markers from here, since neither may import the other.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from schemas.base import WirePart

FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""OpenAI's rule for function names."""

ToolCallFormat = Literal["generic", "hermes"]
"""How a model writes tool calls.

* ``generic``: the whole reply is one JSON object, ``{"tool_call": {"name", "arguments"}}``,
  ``{"tool_calls": [{"name", "arguments"}, ...]}`` (parallel calls) or ``{"response": "<text>"}`` (no call). The
  head describes the tools and this shape in the system turn. For templates without tool support (the bundled Gemma
  has no template at all) and for native formats swarmroute does not parse; llama.cpp's server calls the same
  fallback "Generic".
* ``hermes``: the template renders ``tools`` itself and the model writes
  ``<tool_call>{"name", "arguments"}</tool_call>`` blocks, possibly after some text (Hermes, Qwen 2.5 and many
  fine-tunes).
"""

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"

GENERIC_CALL_KEY = "tool_call"
GENERIC_CALLS_KEY = "tool_calls"
GENERIC_RESPONSE_KEY = "response"


class FunctionSpec(WirePart):
    """One function the model may call: OpenAI's ``tools[].function``."""

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


ToolMode = Literal["auto", "required", "function"]
"""``auto``: a call or text; ``required``: at least one call to any tool; ``function``: a call to ``function``.
(``tool_choice: none`` never reaches a node: the gateway then sends no tools and no constraint.)"""


class ToolSet(WirePart):
    """The tools of a request and what the caller allows: OpenAI ``tools``, ``tool_choice``, ``parallel_tool_calls``.
    The head renders it into the prompt (``Prompt.tools``); the tail constrains the reply with it
    (``ToolCallConstraint``)."""

    tools: list[FunctionSpec] = Field(min_length=1)
    mode: ToolMode = "auto"
    function: str | None = Field(default=None, description="the function to call when mode is 'function'")
    parallel: bool = Field(default=True, description="OpenAI parallel_tool_calls: several calls in one reply")

    @model_validator(mode="after")
    def _named(self) -> ToolSet:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        if self.mode == "function" and self.function not in names:
            raise ValueError(f"function {self.function!r} is not among the tools {names}")
        return self

    def callable_tools(self) -> list[FunctionSpec]:
        """The tools a reply may call under this mode."""
        return [t for t in self.tools if self.mode != "function" or t.name == self.function]
