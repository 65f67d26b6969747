"""What a request asks the route to enforce: its tools (for the head to render) and its output constraint (for the
tail to sample under), checked at the edge so that bad input is a 400 naming the field before any node is asked.

JSON Schemas (``response_format``, each tool's ``parameters``) are checked here with ``jsonschema`` against their
own metaschema, for keywords the tail's grammar cannot enforce (``schemas.constraint``), and for what no JSON value
can satisfy (``unsatisfiable``: the grammar would then admit no complete reply, and the model would write until
``max_tokens``); the tail turns what passes into a grammar. The tool-call format comes from the head
(``TokenizeReply.tool_format``), so the constraint is built after tokenizing: ``tools_of`` -> tokenize ->
``constraint_for``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeGuard

import jsonschema

from schemas.constraint import (
    UNENFORCED_SCHEMA_KEYWORDS,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    OutputConstraint,
    ToolCallConstraint,
)
from schemas.errors import BadRequestError
from schemas.openai import (
    ChatCompletionRequest,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    NamedToolChoice,
    ResponseFormat,
)
from schemas.session import MAX_CHOICES
from schemas.tools import FunctionSpec, ToolCallFormat, ToolMode, ToolSet

FormatKind = Literal["text", "json_object", "json_schema"]

MAX_SCHEMA_DEPTH = 40
"""Most levels of JSON nesting a schema may have (about half as many levels of schemas in schemas). Below the body's
limit (``bus.http_edge.MAX_JSON_DEPTH``) by the levels the schema sits under in a node's session request, so that a
schema the gateway accepts always reaches the tail."""

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties", "additionalItems")


def _subschemas(schema: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, Mapping):
            yield from (v for v in value.values() if isinstance(v, Mapping))
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            yield from (v for v in value if isinstance(v, Mapping))
    for key in _SCHEMA_VALUES:
        value = schema.get(key)
        if isinstance(value, Mapping):
            yield value
        elif isinstance(value, list):  # draft 4's tuple "items"
            yield from (v for v in value if isinstance(v, Mapping))


def _unenforced(schema: Mapping[str, Any]) -> str | None:
    """The first keyword of ``schema`` (or a subschema) the grammar would ignore. Property names are not keywords:
    only schema positions are searched."""
    for key in schema:
        if key in UNENFORCED_SCHEMA_KEYWORDS:
            return key
    for sub in _subschemas(schema):
        found = _unenforced(sub)
        if found:
            return found
    return None


def _depth(value: object) -> int:
    """Levels of JSON nesting (a scalar is 0), counted without recursion."""
    deepest = 0
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, level + 1) for c in children if isinstance(c, dict | list))
    return deepest


def check_schema(schema: object, param: str) -> dict[str, Any]:
    """A JSON Schema the tail can enforce, or a 400 naming ``param``: it must be an object, at most
    ``MAX_SCHEMA_DEPTH`` deep, valid against its metaschema (``$schema``, else draft 2020-12), free of keywords the
    grammar cannot enforce, and not obviously unsatisfiable (``unsatisfiable``)."""
    if not isinstance(schema, dict):
        raise BadRequestError(f"the JSON Schema must be an object, got {type(schema).__name__}", param=param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise BadRequestError(f"the JSON Schema is nested more than {MAX_SCHEMA_DEPTH} levels deep", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the root"
        raise BadRequestError(f"invalid JSON Schema at {where}: {exc.message}", param=param) from None
    found = unsatisfiable(schema)
    if found is not None:
        where, why = found
        raise BadRequestError(f"the JSON Schema at {where or 'the root'} admits no value: {why}; the reply could "
                              f"never be complete, so it is refused", param=param)
    keyword = _unenforced(schema)
    if keyword:
        raise BadRequestError(f"JSON Schema keyword {keyword!r} cannot be enforced while sampling; the reply could "
                              f"break it, so it is refused", param=param)
    return schema


_BOUNDS = (("minLength", "maxLength", "string"), ("minItems", "maxItems", "array"),
           ("minProperties", "maxProperties", "object"), ("minimum", "maximum", "number"))


def unsatisfiable(schema: object, path: str = "") -> tuple[str, str] | None:
    """Where in ``schema`` a subschema admits no JSON value, and why; ``None`` when none is found.

    Any subschema counts, used or not: the grammar is built from all of them, and one the model can enter but never
    leave ends the reply at ``max_tokens`` with invalid JSON. Found: the ``false`` schema; a lower bound above its
    upper bound (``minLength``/``maxLength``, ``minItems``/``maxItems``, ``minProperties``/``maxProperties``,
    ``minimum``/``maximum`` and the exclusive bounds); an empty ``enum`` or ``type`` list; an ``enum`` or ``const``
    no member of which the rest of its schema admits; a ``required`` property that ``properties`` sets to ``false``
    or that ``additionalProperties: false`` leaves out; items required (``minItems``) but ``items: false`` or more
    than ``prefixItems`` allow. Not found (the check is syntactic, per subschema): contradictions across
    ``allOf``/``$ref`` or between a subschema and its parent, a ``pattern`` no string matches, and whatever needs
    reasoning about the values themselves."""
    if schema is False:
        return path, "it is the schema false"
    if not isinstance(schema, Mapping):
        return None
    found = _local_contradiction(schema)
    if found is not None:
        return path, found
    for key, sub in _children(schema):
        inner = unsatisfiable(sub, f"{path}/{key}" if path else key)
        if inner is not None:
            return inner
    return None


def _children(schema: Mapping[str, Any]) -> Iterator[tuple[str, object]]:
    """Every subschema with its path, ``false`` ones included (``_subschemas`` yields objects only)."""
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, Mapping):
            yield from ((f"{key}/{name}", v) for name, v in value.items() if isinstance(v, Mapping))
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            yield from ((f"{key}/{i}", v) for i, v in enumerate(value) if isinstance(v, Mapping))
    for key in _SCHEMA_VALUES:
        value = schema.get(key)
        if isinstance(value, Mapping):
            yield key, value
        elif isinstance(value, list):
            yield from ((f"{key}/{i}", v) for i, v in enumerate(value) if isinstance(v, Mapping))
    for key in ("anyOf", "oneOf"):  # one false branch is harmless; all of them are not (below)
        value = schema.get(key)
        if isinstance(value, list) and value and all(v is False for v in value):
            yield key, False
    value = schema.get("allOf")
    if isinstance(value, list):
        yield from ((f"allOf/{i}", v) for i, v in enumerate(value) if v is False)


def _local_contradiction(schema: Mapping[str, Any]) -> str | None:
    for low, high, what in _BOUNDS:
        lo, hi = schema.get(low), schema.get(high)
        if _number(lo) and _number(hi) and lo > hi:
            return f"{low} {lo} is more than {high} {hi}: no {what} satisfies both"
    lo = schema.get("exclusiveMinimum", schema.get("minimum"))
    hi = schema.get("exclusiveMaximum", schema.get("maximum"))
    exclusive = "exclusiveMinimum" in schema or "exclusiveMaximum" in schema
    if exclusive and _number(lo) and _number(hi) and lo >= hi:
        return f"no number lies between the bounds {lo} and {hi}"
    if schema.get("type") == []:
        return "its type list is empty"
    if schema.get("enum") == []:
        return "its enum is empty"
    found = _no_candidate(schema)
    if found is not None:
        return found
    return _missing_required(schema) or _missing_items(schema)


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _no_candidate(schema: Mapping[str, Any]) -> str | None:
    """An ``enum``/``const`` the rest of the schema refuses every member of (checked with ``jsonschema`` itself)."""
    for key in ("enum", "const"):
        if key not in schema:
            continue
        candidates = schema[key] if key == "enum" else [schema[key]]
        if not isinstance(candidates, list):
            continue
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const", "$ref", "$defs", "definitions")}
        try:
            check = jsonschema.validators.validator_for(schema)(rest)
            if not any(check.is_valid(c) for c in candidates):
                return f"no value of its {key} is valid against the rest of it"
        except Exception:  # a $ref out of reach without its root (referencing's Unresolvable), and the like
            continue  # what cannot be checked alone is not refused
    return None


def _missing_required(schema: Mapping[str, Any]) -> str | None:
    required = schema.get("required")
    if not isinstance(required, list):
        return None
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    closed = schema.get("additionalProperties") is False
    for name in required:
        if properties.get(name) is False:
            return f"the required property {name!r} is set to false"
        if closed and isinstance(name, str) and name not in properties:
            return f"the required property {name!r} is not among its properties and additionalProperties is false"
    return None


def _missing_items(schema: Mapping[str, Any]) -> str | None:
    needed = schema.get("minItems")
    if not _number(needed) or needed <= 0:
        return None
    prefix = schema.get("prefixItems")
    fixed = len(prefix) if isinstance(prefix, list) else 0
    if schema.get("items") is False and needed > fixed:
        return f"minItems {needed} but items is false" + (f" after {fixed} prefixItems" if fixed else "")
    return None


def tool_set(tools: list[FunctionSpec] | None, choice: Literal["auto", "required", "none", "function"] | None, *,
             function: str | None = None,
             parallel: bool | None = None) -> ToolSet | None:
    """The tools the head renders, or ``None`` (no tools, or ``tool_choice: none``). ``choice`` is ``auto``,
    ``required``, ``none``, ``function`` (with ``function``) or ``None`` (auto when there are tools)."""
    if not tools or choice == "none":
        return None
    for tool in tools:
        check_schema(tool.parameters, "tools")
    if choice == "function" and function not in {t.name for t in tools}:
        raise BadRequestError(f"tool_choice names {function!r}, which is not among the tools", param="tool_choice")
    mode: ToolMode = "auto" if choice is None else choice
    return ToolSet(tools=tools, mode=mode, function=function if mode == "function" else None,
                   parallel=True if parallel is None else parallel)


def constraint_for(kind: FormatKind, schema: dict[str, Any] | None, tools: ToolSet | None,
                   tool_format: ToolCallFormat | None) -> OutputConstraint | None:
    """The tail's constraint for a reply format (``text``, ``json_object``, ``json_schema`` with ``schema``) and the
    rendered tools (in the head's ``tool_format``). ``None``: sample freely."""
    if kind == "json_schema":
        schema = check_schema(schema, "response_format")
    if tools is not None:
        if tool_format is None:
            raise BadRequestError("the model rendered no tool format for these tools", param="tools")
        if kind != "text" and (tool_format != "generic" or tools.mode != "auto"):
            # Only the generic format's text reply is JSON the grammar can shape; elsewhere the two would conflict.
            raise BadRequestError("response_format other than text cannot be combined with tool_choice "
                                  f"{tools.mode!r} for this model's {tool_format} tool-call format",
                                  param="response_format")
        response_schema = schema if kind == "json_schema" else ({"type": "object"} if kind == "json_object" else None)
        return ToolCallConstraint(**tools.model_dump(), format=tool_format, response_schema=response_schema)
    if kind == "json_object":
        return JsonObjectConstraint()
    if kind == "json_schema":
        assert schema is not None
        return JsonSchemaConstraint(json_schema=schema)
    return None


def response_format_of(fmt: ResponseFormat | None) -> tuple[FormatKind, dict[str, Any] | None]:
    """Chat/completions ``response_format`` as ``(kind, schema)``; the schema is checked."""
    if isinstance(fmt, JsonSchemaResponseFormat):
        return "json_schema", check_schema(fmt.json_schema.schema_, "response_format")
    if isinstance(fmt, JsonObjectFormat):
        return "json_object", None
    return "text", None


def chat_tools(req: ChatCompletionRequest) -> ToolSet | None:
    """A chat request's tools, as the head renders them (``Prompt.tools``)."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return tool_set([t.function for t in req.tools or []], "function", function=choice.function.name,
                        parallel=req.parallel_tool_calls)
    return tool_set([t.function for t in req.tools or []], choice, parallel=req.parallel_tool_calls)


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """``SamplingParams.logprobs`` for a chat request: off, the sampled token's only (0), or the top N."""
    return (req.top_logprobs or 0) if req.logprobs else None


def check_choices(n: int, max_sessions: int | None) -> None:
    """The choices the route decodes (``n``, or 1 for a greedy request: ``gateway.fanout``) against the route:
    every hop holds one sequence per sampled choice, so more than the smallest hop's ``max_sessions`` can never be
    served (400; a busy route is a 429 from the nodes instead)."""
    if max_sessions is not None and n > max_sessions:
        raise BadRequestError(f"n={n} sampled choices are more than this model's route can hold at once "
                              f"({max_sessions} choices; at temperature 0 any n up to {MAX_CHOICES} is one sequence)",
                              param="n")
