"""Output constraints: what the tail enforces while sampling, with llama.cpp's grammar sampler.

The gateway builds a constraint from ``response_format`` and ``tools`` and sends it in ``SamplingParams``; only the
tail reads it and turns it into a GBNF grammar (``actors/backends/llamacpp/grammar.py``: llama-cpp-python's JSON Schema
converter), because the grammar needs the node's llama.cpp and the gateway must not import it. The gateway checks
JSON Schemas itself (``jsonschema``) so that an invalid schema is a 400 at the edge, and refuses keywords the
converter would silently ignore (``UNENFORCED_SCHEMA_KEYWORDS``): every reply then validates against its schema,
whatever the model, unless it is cut short by ``max_tokens``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from schemas.base import WirePart
from schemas.tools import ToolCallFormat, ToolSet

UNENFORCED_SCHEMA_KEYWORDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems", "contains",
    "minContains", "maxContains", "minProperties", "maxProperties", "patternProperties", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "not", "if", "then", "else", "unevaluatedItems",
    "unevaluatedProperties",
})
"""JSON Schema keywords llama-cpp-python 0.3.36's converter ignores: a schema using them could be answered with JSON
the schema rejects, so they are refused with a 400 instead."""


class JsonObjectConstraint(WirePart):
    """Any JSON object (OpenAI ``response_format: {"type": "json_object"}``)."""

    type: Literal["json_object"] = "json_object"


class JsonSchemaConstraint(WirePart):
    """JSON valid against ``json_schema`` (OpenAI ``response_format: {"type": "json_schema"}``)."""

    type: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any]
    name: str = ""


class ToolCallConstraint(ToolSet):
    """The reply is a tool call (or, with ``mode: auto``, a call or text), written in ``format``: the format the
    head rendered the tools for (``TokenizeReply.tool_format``)."""

    type: Literal["tool_call"] = "tool_call"
    format: ToolCallFormat = "generic"
    response_schema: dict[str, Any] | None = Field(
        default=None, description="auto mode, generic format: the schema of the text reply (response_format)")


class GrammarConstraint(WirePart):
    """A raw GBNF grammar (llama.cpp's extension, for callers that write their own)."""

    type: Literal["gbnf"] = "gbnf"
    grammar: str = Field(min_length=1)
    root: str = "root"


OutputConstraint = Annotated[JsonObjectConstraint | JsonSchemaConstraint | ToolCallConstraint | GrammarConstraint,
                             Field(discriminator="type")]
