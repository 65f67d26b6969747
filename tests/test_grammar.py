"""actors.backends.llamacpp.grammar: constraints become grammars llama.cpp accepts; on the real model the reply holds.

The tool-call tests run the bundled Gemma 3 270M (pretrained, no chat tuning) with the head's rendering, the
tail's grammar and the gateway's parser: with ``tool_choice`` ``required`` or a named function the reply is a
call whose arguments validate against the function's schema, whatever this small model would write on its own.
"""

from __future__ import annotations

import ctypes
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backend import StepInput  # noqa: E402
from actors.backends import load_backend  # noqa: E402
from actors.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from actors.backends.llamacpp.grammar import JSON_CHAR_RULE, MAX_PARALLEL_CALLS, Grammar, grammar_for  # noqa: E402
from actors.backends.llamacpp.sampling import Sampler, _grammar_sampler  # noqa: E402
from gateway.tools import parse_reply  # noqa: E402
from schemas.constraint import (  # noqa: E402
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    OutputConstraint,
    ToolCallConstraint,
)
from schemas.errors import BadRequestError  # noqa: E402
from schemas.reasoning import ReasoningStart  # noqa: E402
from schemas.session import Prompt, SamplingParams  # noqa: E402
from schemas.tools import FunctionSpec, ToolCallFormat, ToolSet  # noqa: E402

WEATHER = FunctionSpec(name="get_weather", description="Current weather in a city", parameters={
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}})
TIME = FunctionSpec(name="get_time", description="Current time in a time zone", parameters={
    "type": "object", "required": ["tz"], "properties": {"tz": {"type": "string", "maxLength": 40}}})
ORDER = FunctionSpec(name="place_order", description="Order items", parameters={
    "type": "object", "required": ["items"], "$defs": {"item": {
        "type": "object", "required": ["sku", "qty"],
        "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}}}},
    "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/item"}},
                   "note": {"type": "string", "maxLength": 30}}})
TOOLS = [WEATHER, TIME, ORDER]
SPECS = {t.name: t for t in TOOLS}


@pytest.fixture(scope="module")
def vocab(gemma_path: Path) -> Iterator[Any]:
    """Only the vocabulary (no weights): what a grammar sampler needs."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(gemma_path).encode(), params)
    assert model
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


CONSTRAINTS: dict[str, OutputConstraint] = {
    "json_object": JsonObjectConstraint(),
    "json_schema": JsonSchemaConstraint(json_schema=ORDER.parameters),
    "generic required": ToolCallConstraint(tools=TOOLS, mode="required", parallel=False),
    "generic auto parallel": ToolCallConstraint(tools=TOOLS, mode="auto", response_schema={"type": "object"}),
    "generic function": ToolCallConstraint(tools=TOOLS, mode="function", function="get_time"),
    "hermes required": ToolCallConstraint(tools=TOOLS, mode="required", format="hermes"),
    "hermes auto (lazy)": ToolCallConstraint(tools=TOOLS, mode="auto", format="hermes", parallel=False),
    "gbnf": GrammarConstraint(grammar='root ::= "yes" | "no"'),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_constraint_is_a_grammar_llama_cpp_accepts(vocab: Any, name: str) -> None:
    constraint = CONSTRAINTS[name]
    grammar = grammar_for(constraint)
    sampler = Sampler(SamplingParams(constraint=constraint), n_vocab=llama_cpp.llama_vocab_n_tokens(vocab),
                      vocab=vocab)
    try:
        assert sampler.constrained
    finally:
        sampler.close()
    assert bool(grammar.triggers) == (name == "hermes auto (lazy)")
    if "char ::=" in grammar.text:  # JSON strings: no raw control characters (the converter's own rule allows them)
        assert f"char ::= {JSON_CHAR_RULE}" in grammar.text.splitlines()


@pytest.mark.parametrize(("schema", "why"), [
    ({"type": "string", "pattern": "abc"}, "Pattern must start with"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "Fetching remote schemas"),
    ({"type": "strange"}, "Unrecognized schema"),
])
def test_a_schema_the_converter_cannot_enforce_is_a_400_naming_the_field(schema: dict[str, object], why: str,
                                                                        ) -> None:
    with pytest.raises(BadRequestError, match=why) as info:
        grammar_for(JsonSchemaConstraint(json_schema=schema))
    assert info.value.param == "response_format" and info.value.status == 400
    with pytest.raises(BadRequestError) as info:
        grammar_for(ToolCallConstraint(tools=[FunctionSpec(name="f", parameters=schema)], mode="required"))
    assert info.value.param == "tools"


@pytest.mark.slow
def test_a_grammar_llama_cpp_cannot_parse_is_a_400_naming_the_field(vocab: Any) -> None:
    with pytest.raises(BadRequestError, match="could not parse") as info:
        Sampler(SamplingParams(constraint=GrammarConstraint(grammar="root ::= (")),
                n_vocab=llama_cpp.llama_vocab_n_tokens(vocab), vocab=vocab)
    assert info.value.param == "grammar"


def test_tool_grammars_name_the_function_before_its_arguments() -> None:
    text = grammar_for(ToolCallConstraint(tools=[WEATHER], mode="required", parallel=False)).text
    rule = next(line for line in text.splitlines() if line.startswith("tool-call ::="))
    assert rule.index("name") < rule.index("arguments")


def accepted(vocab: Any, grammar: Grammar, text: str, *, per_character: bool) -> str:
    """What llama.cpp's grammar sampler makes of ``text`` fed as the model's tokens (or one character a token):
    ``rejected`` at a token it forbids, ``complete`` when it would then allow the end of generation, else
    ``partial``."""
    smpl = _grammar_sampler(vocab, grammar, "test")
    pieces = list(text) if per_character else [text]
    try:
        for piece in pieces:
            raw = piece.encode()
            ids = (llama_cpp.llama_token * (len(raw) + 8))()
            n = llama_cpp.llama_tokenize(vocab, raw, len(raw), ids, len(ids), False, False)
            assert n > 0
            for token in ids[:n]:
                if not _allows(smpl, token):
                    return "rejected"
                llama_cpp.llama_sampler_accept(smpl, token)
        return "complete" if _allows(smpl, llama_cpp.llama_vocab_eos(vocab)) else "partial"
    finally:
        llama_cpp.llama_sampler_free(smpl)


def _allows(smpl: Any, token: int) -> bool:
    one = llama_cpp.llama_token_data(token, 0.0, 0.0)
    llama_cpp.llama_sampler_apply(smpl, ctypes.byref(llama_cpp.llama_token_data_array(ctypes.pointer(one), 1, -1,
                                                                                          False)))
    return math.isfinite(one.logit)


AFTER_REASONING: list[tuple[ReasoningStart, str, str]] = [
    ("open", "I add 3 and 4.\n</think>\n\n{}", "complete"),
    ("open", 'a </thi< b <</think </think>{"a": 1}', "complete"),  # pieces of the tag inside the block
    ("open", "</think>{}", "complete"),  # an empty block
    ("open", "{}", "partial"),  # JSON inside the block is reasoning: the block must still close
    ("open", "x</think>y</think>{}", "rejected"),  # the first </think> ends the block
    ("open", "x</think>\n\n", "partial"),
    ("closed", "{}", "complete"),  # no block: the constraint from the first token, as before
    ("closed", "\n<think>\nhm, {\n</think>\n\n{}", "complete"),  # the reply opens one itself
    ("closed", "<think>a</think>b", "rejected"),
    ("closed", "Hm <think>a</think>{}", "rejected"),  # a later tag is text, and text is not JSON
]


@pytest.mark.slow
@pytest.mark.parametrize(("start", "text", "expected"), AFTER_REASONING)
def test_a_constraint_applies_after_the_think_block(vocab: Any, start: ReasoningStart, text: str,
                                                    expected: str) -> None:
    grammar = grammar_for(JsonObjectConstraint(), start)
    assert accepted(vocab, grammar, text, per_character=False) == expected
    assert accepted(vocab, grammar, text, per_character=True) == expected


@pytest.mark.slow
@pytest.mark.parametrize("start", ["open", "closed"])
def test_a_lazy_grammar_is_triggered_only_after_the_think_block(vocab: Any, start: ReasoningStart) -> None:
    grammar = grammar_for(CONSTRAINTS["hermes auto (lazy)"], start)
    block = "<think>" if start == "closed" else ""
    # A call's tag inside the block is reasoning: the grammar waits, and the text after the block is free.
    assert accepted(vocab, grammar, f"{block}I could use <tool_call> here.</think>\n\nIt is sunny.",
                    per_character=False) == "complete"
    # After the block the tag starts the grammar: what follows must be a call.
    assert accepted(vocab, grammar, f"{block}Ask.</think>\n\n<tool_call>\nsunny", per_character=False) == "rejected"
    assert accepted(vocab, grammar, f"{block}Ask.</think><tool_call>\n" + json.dumps(
        {"name": "get_time", "arguments": {"tz": "UTC"}}) + "\n</tool_call>", per_character=False) == "complete"


# ---- on the real model ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def backend(gemma_path: Path) -> Iterator[LlamaCppBackend]:
    b = load_backend("llamacpp", model_path=gemma_path, n_ctx=1024, max_sessions=2, threads=2)
    assert isinstance(b, LlamaCppBackend)
    yield b
    b.close()


def generate(backend: LlamaCppBackend, tokens: list[int], sampling: SamplingParams, limit: int,
             ) -> tuple[str, bool]:
    """The reply text, and whether it ended by itself within ``limit`` tokens."""
    backend.open_session("t", prompt_tokens=tokens, sampling=sampling)
    try:
        item = StepInput("t", 0, tokens=tokens, sample=True)
        out: list[int] = []
        for i in range(limit):
            token = backend.step([item])[0].token
            assert token is not None
            if backend.is_end_of_generation(token):
                return b"".join(backend.token_bytes(t) for t in out).decode(), True
            out.append(token)
            item = StepInput("t", len(tokens) + i, tokens=[token], sample=True)
        return b"".join(backend.token_bytes(t) for t in out).decode(errors="replace"), False
    finally:
        backend.close_session("t")


def reply(backend: LlamaCppBackend, tokens: list[int], sampling: SamplingParams, limit: int = 200) -> str:
    text, ended = generate(backend, tokens, sampling, limit)
    assert ended, f"no end of generation in {limit} tokens: {text!r}"
    return text


def tool_reply(backend: LlamaCppBackend, question: str, tools: ToolSet, **sampling: Any) -> tuple[str, ToolCallFormat]:
    """Head: render with the tools; tail: constrain in the head's format. The reply text and that format."""
    tokens = backend.tokenize(Prompt(messages=[{"role": "user", "content": question}], tools=tools))
    fmt = backend.tool_format()
    constraint = ToolCallConstraint(**tools.model_dump(), format=fmt)
    return reply(backend, tokens, SamplingParams(constraint=constraint, **sampling)), fmt


def assert_valid_calls(text: str, fmt: ToolCallFormat, allowed: set[str]) -> list[str]:
    parsed = parse_reply(text, fmt)
    assert parsed.tool_calls and parsed.content is None, text
    for call in parsed.tool_calls:
        assert call.name in allowed
        jsonschema.validate(json.loads(call.arguments), SPECS[call.name].parameters)
    return [c.name for c in parsed.tool_calls]


@pytest.mark.slow
@pytest.mark.parametrize("question", ["What is the weather in Paris?", "Order two apples for me."])
def test_required_tool_call_parses_and_validates(backend: LlamaCppBackend, question: str) -> None:
    tools = ToolSet(tools=TOOLS, mode="required", parallel=False)
    text, fmt = tool_reply(backend, question, tools, temperature=0.0)
    assert fmt == "generic"  # the bundled GGUF has no template: the Gemma fallback cannot render tools natively
    assert len(assert_valid_calls(text, fmt, set(SPECS))) == 1


@pytest.mark.slow
def test_a_named_function_is_the_one_called(backend: LlamaCppBackend) -> None:
    tools = ToolSet(tools=TOOLS, mode="function", function="place_order", parallel=False)
    text, fmt = tool_reply(backend, "What is the weather in Paris?", tools, temperature=0.0)
    assert assert_valid_calls(text, fmt, {"place_order"}) == ["place_order"]


@pytest.mark.slow
def test_parallel_calls_are_bounded_and_valid(backend: LlamaCppBackend) -> None:
    tools = ToolSet(tools=TOOLS, mode="required")
    text, fmt = tool_reply(backend, "What is the weather and the time in Paris?", tools, temperature=0.0)
    assert 1 <= len(assert_valid_calls(text, fmt, set(SPECS))) <= MAX_PARALLEL_CALLS


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_calls_hold_when_sampling_hot(backend: LlamaCppBackend, seed: int) -> None:
    tools = ToolSet(tools=TOOLS, mode="required", parallel=False)
    text, fmt = tool_reply(backend, "What is the weather in Paris?", tools, temperature=1.0, seed=seed)
    assert_valid_calls(text, fmt, set(SPECS))


@pytest.mark.slow
def test_auto_replies_are_a_call_or_text_in_the_fallback_format(backend: LlamaCppBackend) -> None:
    tools = ToolSet(tools=TOOLS, mode="auto", parallel=False)
    text, fmt = tool_reply(backend, "What is the weather in Paris?", tools, temperature=0.0)
    envelope = json.loads(text)
    assert set(envelope) in ({"tool_call"}, {"response"})
    parsed = parse_reply(text, fmt)
    assert (parsed.content == envelope.get("response")) and (bool(parsed.tool_calls) == ("tool_call" in envelope))


HERMES_FEW_SHOT = ('Tools: get_weather(city, unit), get_time(tz).\nUser: What is the weather in Rome?\n'
                   'Assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n'
                   '</tool_call>\nUser: What is the weather in Paris?\nAssistant:')


@pytest.mark.slow
def test_hermes_required_and_lazy_auto_grammars_on_the_model(backend: LlamaCppBackend) -> None:
    # No GGUF template here renders hermes, so the prompt is written out; the grammars are what is tested.
    tokens = backend.tokenize(Prompt(text=HERMES_FEW_SHOT))
    required = ToolCallConstraint(tools=TOOLS, mode="required", format="hermes", parallel=False)
    assert_valid_calls(reply(backend, tokens, SamplingParams(temperature=0.0, constraint=required)), "hermes",
                       set(SPECS))
    # Auto is lazy: free text until the model writes <tool_call>, then the call is constrained. Left alone, this
    # model copies the example's tag but writes arguments the schema does not allow, and goes on talking.
    free, ended = generate(backend, tokens, SamplingParams(temperature=0.0), limit=60)
    loose = parse_reply(free, "hermes").tool_calls[0]
    assert not ended and parse_reply(free, "hermes").content  # it went on writing text after the call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(loose.arguments), SPECS[loose.name].parameters)
    auto = ToolCallConstraint(tools=TOOLS, mode="auto", format="hermes", parallel=False)
    text = reply(backend, tokens, SamplingParams(temperature=0.0, constraint=auto))
    assert "<tool_call>" in text
    assert_valid_calls(text, "hermes", set(SPECS))
