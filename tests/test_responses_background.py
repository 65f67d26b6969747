"""Background responses (issue #31), with the official client against real gateways on one stub swarm (real
nats-server with JetStream): ``background: true``, retrieve, resume after a sequence number on another gateway,
cancel, the retention window, and the 4xx of bad ids and malformed queries.

The gateway-kill cases with real processes and the real model are in tests/test_responses_gateway_loss.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response as SDKResponse

from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.swarm import STUB_MODEL, Swarm, Swarms, stub
from tests.support.waiting import eventually

QUESTION = "Tell me about routers."
ENDS = ("response.completed", "response.incomplete")
"""A finished response's last event: ``incomplete`` when ``max_output_tokens`` cut it (the stub rarely ends)."""


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The shared machine may be loaded: nodes keep their registry entries through a slow second."""
    return settings.model_copy(update={"registry_ttl_s": 10.0, "heartbeat_s": 1.0})


async def two_gateways(swarms: Swarms, settings: Settings, *, delay_s: float = 0.0) -> tuple[Swarm, Gateway]:
    swarm = await swarms.start(settings, [stub(0, 4, delay_s=delay_s), stub(4, 8, delay_s=delay_s)])
    other = await swarms.actor(Gateway(settings, port=0))
    return swarm, other


async def events_of(stream: AsyncIterator[Any]) -> list[Any]:
    return [event async for event in stream]


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def test_a_background_response_is_retrieved_and_resumed_after_n_on_another_gateway(
        swarms: Swarms, settings: Settings) -> None:
    swarm, other = await two_gateways(swarms, settings)
    a, b = client(swarm.url), client(other.url)
    created = await a.responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                       background=True)
    assert created.background is True and created.status in ("queued", "in_progress")
    assert created.id.startswith("resp_")
    await swarm.freed(timeout=20)  # it ran to its end with nobody reading

    whole = await events_of(await b.responses.retrieve(created.id, stream=True))
    seqs = [e.sequence_number for e in whole]
    assert seqs == list(range(len(whole)))
    assert whole[0].type == "response.created" and whole[-1].type in ENDS
    n = len(whole) // 2
    rest = await events_of(await a.responses.retrieve(created.id, stream=True, starting_after=n))
    assert [e.model_dump() for e in rest] == [e.model_dump() for e in whole[n + 1:]]  # the same events, item ids too

    final = await b.responses.retrieve(created.id)
    assert isinstance(final, SDKResponse) and final.id == created.id
    assert final.status == whole[-1].response.status and final.status in ("completed", "incomplete")
    assert final.output_text == text_of(whole) and final.output_text
    assert final.usage is not None and 0 < final.usage.output_tokens <= 24
    assert whole[-1].response.output_text == final.output_text


async def test_a_background_stream_resumes_where_it_was_cut_with_every_later_event_once(
        swarms: Swarms, settings: Settings) -> None:
    swarm, other = await two_gateways(swarms, settings, delay_s=0.01)
    stream = await client(swarm.url).responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=40,
                                                      temperature=0, background=True, stream=True)
    seen: list[Any] = []
    async for event in stream:
        seen.append(event)
        if sum(e.type == "response.output_text.delta" for e in seen) == 5:
            break  # the client drops its connection mid-decode
    await stream.close()
    response_id = seen[0].response.id
    rest = await events_of(await client(other.url).responses.retrieve(response_id, stream=True,
                                                                       starting_after=seen[-1].sequence_number))
    joined = seen + rest
    assert [e.sequence_number for e in joined] == list(range(len(joined)))
    assert joined[-1].type in ENDS  # the session ran on without its first client
    assert text_of(joined) == joined[-1].response.output_text
    await swarm.freed()


async def test_a_stopping_gateway_leaves_its_background_response_running(swarms: Swarms, settings: Settings) -> None:
    swarm, other = await two_gateways(swarms, settings, delay_s=0.02)
    created = await client(swarm.url).responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=60,
                                                       temperature=0, background=True)
    await swarm.gateway.stop()
    events = await events_of(await client(other.url).responses.retrieve(created.id, stream=True))
    assert events[-1].type in ENDS and events[-1].response.usage.output_tokens > 5
    await swarm.freed()


async def test_cancel_ends_the_session_on_its_route(swarms: Swarms, settings: Settings) -> None:
    swarm, other = await two_gateways(swarms, settings, delay_s=0.02)
    a, b = client(swarm.url), client(other.url)
    created = await a.responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=2000, temperature=0,
                                       background=True)

    async def some_text() -> bool:
        return bool((await b.responses.retrieve(created.id)).output_text)

    await eventually(some_text, timeout=20, what="some output of the running response")
    running = await b.responses.retrieve(created.id)
    assert running.status == "in_progress" and running.output_text  # the output so far
    cancelled = await b.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.id == created.id
    await swarm.freed()  # every hop freed it, and the gateway that follows it closed it
    after = await a.responses.retrieve(created.id)
    assert after.status == "cancelled" and after.output_text.startswith(running.output_text)
    events = await events_of(await a.responses.retrieve(created.id, stream=True))
    assert events[-1].type not in ENDS  # the stream just ends (the SDK has no cancelled event)
    assert (await a.responses.cancel(created.id)).status == "cancelled"  # again: as it stands


@pytest.mark.parametrize("bad", ["nope", "resp_123", "resp_" + "0" * 32, "resp_" + "A" * 32])
async def test_unknown_ids_are_404s_in_openai_shape(swarms: Swarms, settings: Settings, bad: str) -> None:
    swarm, _ = await two_gateways(swarms, settings)
    api = client(swarm.url)
    with pytest.raises(openai.NotFoundError) as raised:
        await api.responses.retrieve(bad)
    body = raised.value.body
    assert isinstance(body, dict) and body["code"] == "response_not_found" and bad in body["message"]
    with pytest.raises(openai.NotFoundError):
        await api.responses.cancel(bad)
    with pytest.raises(openai.NotFoundError):
        await events_of(await api.responses.retrieve(bad, stream=True, starting_after=3))


async def test_a_plain_response_is_not_kept(swarms: Swarms, settings: Settings) -> None:
    swarm, _ = await two_gateways(swarms, settings)
    api = client(swarm.url)
    plain = await api.responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=4)
    assert plain.background is False
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(plain.id)


@pytest.mark.parametrize("query,param", [
    ("stream=true&starting_after=abc", "starting_after"),
    ("stream=true&starting_after=-1", "starting_after"),
    ("stream=true&starting_after=1.5", "starting_after"),
    ("starting_after=3", "starting_after"),  # a position in a stream, without one
    ("stream=maybe", "stream"),
    ("strem=true", "strem"),
])
async def test_malformed_queries_are_400s_naming_the_parameter(swarms: Swarms, settings: Settings, query: str,
                                                               param: str) -> None:
    swarm, _ = await two_gateways(swarms, settings)
    created = await client(swarm.url).responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=4,
                                                       background=True)
    async with httpx.AsyncClient(timeout=10) as http:
        answer = await http.get(f"{swarm.base_url}/responses/{created.id}?{query}")
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


async def test_past_the_retention_window_a_response_is_a_404(swarms: Swarms, settings: Settings) -> None:
    kept = settings.model_copy(update={"responses_retention_s": 1.0})
    swarm, _ = await two_gateways(swarms, kept)
    api = client(swarm.url)
    created = await api.responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=4, background=True)
    await swarm.freed()
    assert (await api.responses.retrieve(created.id)).status in ("completed", "incomplete")

    async def gone() -> bool:
        try:
            await api.responses.retrieve(created.id)
        except openai.NotFoundError as exc:
            return isinstance(exc.body, dict) and exc.body["code"] == "response_not_found"
        return False

    await eventually(gone, timeout=10, interval=0.2, what="the response gone past its window")
    streams = [s.config.name for s in await swarm.gateway.nc.jetstream().streams_info()]
    assert not [s for s in streams if s and s.startswith(f"{kept.namespace}_response_")]  # deleted, not only hidden


async def test_background_needs_no_stream_reader_to_finish_and_a_late_reader_gets_all(
        swarms: Swarms, settings: Settings) -> None:
    swarm, other = await two_gateways(swarms, settings)
    api = client(other.url)
    created = await api.responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=8, background=True)
    done = await eventually(lambda: _status(api, created.id), timeout=20, what="the response completing")
    assert done in ("completed", "incomplete")
    late = await events_of(await client(swarm.url).responses.retrieve(created.id, stream=True, starting_after=0))
    assert late[0].sequence_number == 1 and late[-1].type in ENDS


async def _status(api: openai.AsyncOpenAI, response_id: str) -> str | None:
    status = (await api.responses.retrieve(response_id)).status
    return status if status not in ("queued", "in_progress") else None


# ---- under deploy/nats/auth.conf's roles -------------------------------------------------------------------------

from pathlib import Path  # noqa: E402

from actors.node import Node, NodeConfig  # noqa: E402
from actors.tracker import Tracker  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from tests.support.swarm import wait_model  # noqa: E402
from tests.test_nats_auth import auth_server, passwords, role_settings  # noqa: E402, F401 - fixtures


async def test_background_responses_work_within_the_gateway_role(auth_server: EmbeddedNats,  # noqa: F811
                                                                 passwords: dict[str, str],  # noqa: F811
                                                                 tmp_path: Path) -> None:
    home = tmp_path / "home"
    extra = {"registry_ttl_s": 10.0, "heartbeat_s": 1.0, "responses_retention_s": 2.0}
    tracker_s, node_s, gateway_s = (role_settings(auth_server, home, passwords, r, **extra)
                                    for r in ("tracker", "node", "gateway"))
    async with Tracker(tracker_s) as tracker, Node(NodeConfig("n1", STUB_MODEL), stub(0, 4), node_s), \
            Node(NodeConfig("n2", STUB_MODEL), stub(4, 8, delay_s=0.02), node_s), \
            Gateway(gateway_s, port=0) as gateway, Gateway(gateway_s, port=0) as other:
        await wait_model(tracker, STUB_MODEL, n_nodes=2)
        a, b = client(gateway.url), client(other.url)
        done = await a.responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=6, background=True)
        events = await events_of(await b.responses.retrieve(done.id, stream=True, starting_after=1))
        assert events[0].sequence_number == 2 and events[-1].type in ENDS
        long = await a.responses.create(model=STUB_MODEL, input=QUESTION, max_output_tokens=2000, background=True)
        assert (await b.responses.cancel(long.id)).status == "cancelled"

        async def swept() -> bool:
            try:
                await b.responses.retrieve(done.id)
            except openai.NotFoundError:
                return True
            return False

        await eventually(swept, timeout=15, interval=0.2, what="the response gone past its window")
