"""Output constraints -> GBNF grammars for llama.cpp's grammar sampler (the tail's side of ``schemas.constraint``).

JSON Schemas go through llama-cpp-python's own converter (``llama_cpp.llama_grammar.SchemaConverter``, the Python
port of llama.cpp's ``json-schema-to-grammar``), with one correction: its string ``char`` rule admits raw control
characters (a literal newline inside a string), which JSON forbids, so it is replaced by llama.cpp's current rule.

Tool calls are grammars over the same converter, in the format the head rendered the tools for:

* ``generic``: one JSON object, ``{"tool_call": {"name": <const>, "arguments": <the function's parameters>}}``, or
  ``{"tool_calls": [...]}`` when parallel calls are allowed; in ``auto`` mode also ``{"response": <text>}``.
* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks. ``required`` and a named function
  constrain the whole reply to calls; ``auto`` is a *lazy* grammar: text is free until the model writes
  ``<tool_call>``, and from there the call is constrained.

``name`` is always written before ``arguments``, so the gateway can stream a call's name before its arguments.

A reply that may start with a think block (issue #27: the head tells where it starts, ``SamplingParams.reasoning``)
is constrained after the block, as llama-server's grammars for reasoning models are (its chat parser's grammar is
an optional ``<think>...</think>`` then the response format): the block's text is free, and only ``</think>`` ends
it. ``open`` (the prompt opened the block): the reply runs to ``</think>`` first; ``closed``: it may open one
first, after nothing but whitespace, or go straight to what is enforced. A lazy grammar keeps its laziness: its
triggers count only after the block (llama.cpp starts the grammar at the pattern's first group).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from llama_cpp import llama_grammar

from schemas.constraint import (
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    OutputConstraint,
    ToolCallConstraint,
)
from schemas.errors import BadRequestError
from schemas.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningStart
from schemas.tools import (
    GENERIC_CALL_KEY,
    GENERIC_CALLS_KEY,
    GENERIC_RESPONSE_KEY,
    HERMES_CLOSE,
    HERMES_OPEN,
    FunctionSpec,
)

JSON_CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
"""A character inside a JSON string, as llama.cpp's current converter writes it: no raw control characters."""

_CALL_ORDER = {"name": 0, "arguments": 1}

MAX_PARALLEL_CALLS = 8
"""Most calls one reply may make when parallel calls are allowed. Without a bound a degenerate model (the bundled
270M one, greedy) repeats calls until ``max_tokens`` and its last call is cut off; eight is more than agents ask
for in one turn."""

_SchemaConverter: Any = llama_grammar.SchemaConverter
"""llama-cpp-python's converter is unannotated; it is used through ``Any``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Grammar:
    """A GBNF grammar, its root rule, and (for a lazy grammar) the patterns that switch it on."""

    text: str
    root: str = "root"
    triggers: tuple[str, ...] = ()
    """Empty: the grammar constrains from the first token. Otherwise it waits until the output matches one of these
    regular expressions (llama.cpp's lazy grammar) and constrains from the match on."""


def param_of(constraint: OutputConstraint) -> str:
    """The OpenAI request field a constraint came from, for a 400 that names it."""
    if isinstance(constraint, ToolCallConstraint):
        return "tools"
    if isinstance(constraint, GrammarConstraint):
        return "grammar"
    return "response_format"


_THINK = "swarmroute-think"
"""The prefix of the rules added for a think block (no converter rule name, unlikely in a caller's grammar)."""

THINK_RULES = "\n".join([
    # Text without the closing tag: a "<" starts either a run that breaks off the tag (ends in a character the tag
    # does not continue with; "<" restarts it) or a prefix of the tag that only another "<" (or the tag) follows.
    f"{_THINK}-body ::= ( [^<] | {_THINK}-prefix* {_THINK}-run )* {_THINK}-prefix*",
    f"{_THINK}-prefix ::= " + " | ".join(f'"{THINK_CLOSE[:n]}"' for n in range(1, len(THINK_CLOSE))),
    f'{_THINK}-run ::= "<" ( [^</] | "/" ( [^<t] | "t" ( [^<h] | "h" ( [^<i] | "i" ( [^<n] | "n" ( [^<k] | "k" '
    f'[^<>] ) ) ) ) ) )',
    f"{_THINK}-space ::= [ \\t\\r\\n]{{0,20}}",
])
"""GBNF for a think block's text (``-body``: anything up to, not including, the first ``</think>``) and the
whitespace around it (which the gateway strips)."""


def after_reasoning(grammar: Grammar, start: ReasoningStart) -> Grammar:
    """``grammar`` applied after the think block a reply starting at ``start`` has (``open``) or may have
    (``closed``)."""
    block = f'{_THINK}-body "{THINK_CLOSE}" {_THINK}-space'
    if grammar.triggers:
        # Lazy: the text before a trigger is free anyway; a trigger inside the block must not start the grammar.
        if start == "open":
            triggers = tuple(f"{THINK_CLOSE}[\\s\\S]*?({t})" for t in grammar.triggers)
        else:
            triggers = tuple(p for t in grammar.triggers for p in (
                f"^\\s*{THINK_OPEN}[\\s\\S]*?{THINK_CLOSE}[\\s\\S]*?({t})", f"^(?!\\s*{THINK_OPEN})[\\s\\S]*?({t})"))
        return dataclasses.replace(grammar, triggers=triggers)
    head = block if start == "open" else f'( {_THINK}-space "{THINK_OPEN}" {block} )?'
    return Grammar(f"{grammar.text}\n{_THINK}-root ::= {head} {grammar.root}\n{THINK_RULES}\n", f"{_THINK}-root")


def grammar_for(constraint: OutputConstraint, reasoning: ReasoningStart | None = None) -> Grammar:
    """The grammar enforcing ``constraint`` (after the reply's think block, for a ``reasoning`` start). Raises
    ``BadRequestError`` (naming the request field) for a schema the converter cannot turn into a grammar."""
    grammar = _grammar_for(constraint)
    return grammar if reasoning is None else after_reasoning(grammar, reasoning)


def _grammar_for(constraint: OutputConstraint) -> Grammar:
    try:
        if isinstance(constraint, JsonObjectConstraint):
            return Grammar(_schema_grammar({"type": "object"}))
        if isinstance(constraint, JsonSchemaConstraint):
            return Grammar(_schema_grammar(constraint.json_schema))
        if isinstance(constraint, ToolCallConstraint):
            return _tool_grammar(constraint)
        return Grammar(constraint.grammar, constraint.root)
    except BadRequestError:
        raise
    except Exception as exc:  # the converter asserts, raises KeyError/ValueError/TypeError on what it cannot handle
        raise BadRequestError(f"cannot enforce this JSON Schema while sampling: {type(exc).__name__}: {exc}",
                              param=param_of(constraint)) from None


def _converter() -> Any:
    return _SchemaConverter(prop_order=_CALL_ORDER, allow_fetch=False, dotall=False, raw_pattern=False)


def _finish(conv: Any, extra_rules: str = "") -> str:
    rules: dict[str, str] = conv._rules  # noqa: SLF001 - the converter exposes no other way to amend a rule
    if "char" in rules:
        rules["char"] = JSON_CHAR_RULE
    text: str = conv.format_grammar()
    return text + ("\n" + extra_rules if extra_rules else "")


def _schema_grammar(schema: dict[str, Any]) -> str:
    conv = _converter()
    # A deep copy: resolve_refs rewrites "$ref" values in place, and the constraint may be reused.
    resolved = conv.resolve_refs(json.loads(json.dumps(schema)), "input")
    conv.visit(resolved, "")
    return _finish(conv)


def _call_schema(tool: FunctionSpec, conv: Any, index: int) -> dict[str, Any]:
    # Each tool's parameters resolve their own "#/$defs/..." references against themselves, not against the
    # wrapper schema built around them here.
    params = conv.resolve_refs(json.loads(json.dumps(tool.parameters)), f"tool{index}")
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"]}


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _tool_grammar(c: ToolCallConstraint) -> Grammar:
    conv = _converter()
    call = _one_of([_call_schema(t, conv, i) for i, t in enumerate(c.callable_tools())])
    if c.format == "generic":
        if c.parallel:
            calls: dict[str, Any] = {"type": "object", "required": [GENERIC_CALLS_KEY], "properties": {
                GENERIC_CALLS_KEY: {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}}}
        else:
            calls = {"type": "object", "required": [GENERIC_CALL_KEY], "properties": {GENERIC_CALL_KEY: call}}
        schema = calls
        if c.mode == "auto":
            text = c.response_schema if c.response_schema is not None else {"type": "string"}
            schema = {"anyOf": [calls, {"type": "object", "required": [GENERIC_RESPONSE_KEY],
                                        "properties": {GENERIC_RESPONSE_KEY: text}}]}
        conv.visit(schema, "")
        return Grammar(_finish(conv))
    rule = conv.visit(call, "call")
    block = f'"{HERMES_OPEN}" "\\n"? {rule} "\\n"? "{HERMES_CLOSE}"'
    more = f'("\\n" {block})' + "{0," + str(MAX_PARALLEL_CALLS - 1) + "}"
    root = f"root ::= {block} {more}" if c.parallel else f"root ::= {block}"
    triggers = (HERMES_OPEN,) if c.mode == "auto" else ()
    return Grammar(_finish(conv, root), triggers=triggers)
