"""A widely used third-party client against the gateway: LangChain's ``ChatOpenAI`` (langchain-openai, the ``test``
extra) on the real 2-node llama.cpp route of the bundled Gemma 3 270M, for chat, streaming, structured output and a
tool call. LangChain builds its own requests (its tool and schema conversions, its streaming aggregation), so this
checks that what swarmroute serves is what OpenAI-compatible applications expect, beyond the official SDK.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
import pytest_asyncio
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from bus.server import EmbeddedNats
from tests.support.swarm import Swarm, gemma_route

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "gemma"
_namespaces = itertools.count()


class Colour(BaseModel):
    """A colour and whether it is bright."""

    colour: Literal["red", "green", "blue"]
    bright: bool
    name: str = Field(max_length=20)


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    return json.dumps({"city": city, "temperature": 18, "unit": unit})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, gemma_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async with gemma_route(module_nats.url, gemma_path, tmp_path_factory.mktemp("route"),
                           namespace=f"lc{next(_namespaces)}", max_sessions=2, model_id=MODEL) as s:
        yield s


def chat_model(swarm: Swarm, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=swarm.base_url, api_key="unused",  # type: ignore[arg-type]
                      temperature=0, max_retries=0, timeout=300, **kw)


async def test_langchain_chat_and_streaming(swarm: Swarm) -> None:
    llm = chat_model(swarm, max_completion_tokens=16)
    whole = await llm.ainvoke("What is the capital of France?")
    assert isinstance(whole.content, str) and whole.content
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] <= 16
    pieces = [chunk async for chunk in llm.astream("What is the capital of France?")]
    assert sum(1 for p in pieces if p.content) > 1  # streamed piece by piece
    merged: Any = pieces[0]
    for p in pieces[1:]:
        merged = merged + p
    assert isinstance(merged, AIMessageChunk) and merged.content == whole.content


async def test_langchain_structured_output(swarm: Swarm) -> None:
    llm = chat_model(swarm, max_completion_tokens=120)
    structured = llm.with_structured_output(Colour, method="json_schema", strict=True, include_raw=True)
    out: Any = await structured.ainvoke("Pick a colour.")
    assert out["parsing_error"] is None
    parsed = out["parsed"]
    assert isinstance(parsed, Colour)
    jsonschema.validate(json.loads(out["raw"].content), Colour.model_json_schema())
    # Streamed: LangChain aggregates the chunks and parses the whole.
    chunks = [c async for c in llm.with_structured_output(Colour, method="json_schema", strict=True).astream(
        "Pick a colour.")]
    assert chunks and isinstance(chunks[-1], Colour) and chunks[-1] == parsed


async def test_langchain_tool_call_round_trip(swarm: Swarm) -> None:
    llm = chat_model(swarm, max_completion_tokens=120).bind_tools([get_weather], tool_choice="get_weather",
                                                                  parallel_tool_calls=False)
    question = HumanMessage("What is the weather in Paris?")
    reply: Any = await llm.ainvoke([question])
    assert len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    schema: Any = get_weather.tool_call_schema
    jsonschema.validate(call["args"], schema.model_json_schema())
    result = await asyncio.to_thread(get_weather.invoke, call["args"])
    # The tool's result goes back in the next turn, as LangChain agents do.
    answer: Any = await chat_model(swarm, max_completion_tokens=24).bind_tools([get_weather]).ainvoke(
        [question, reply, ToolMessage(result, tool_call_id=call["id"])])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    streamed: list[Any] = [c async for c in llm.astream([question])]
    merged: Any = streamed[0]
    for c in streamed[1:]:
        merged = merged + c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]


