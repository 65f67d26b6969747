"""gateway/dashboard.py: the dashboard's paths on a real gateway over a real swarm (stub backend, real NATS), read
as a script would (httpx, the SSE stream): what it shows, and the API keys guarding it. test_dashboard_browser.py
reads the same page in a real browser against ``swarmroute up``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bus.server import EmbeddedNats
from gateway.dashboard import COOKIE
from schemas.settings import Settings
from tests.support.swarm import STUB_MODEL, Swarm, Swarms, make_settings, stub
from tests.support.waiting import eventually

KEY = "sk-dashboard-test"


async def _state(client: httpx.AsyncClient, swarm: Swarm, **kw: Any) -> dict[str, Any]:
    response = await client.get(swarm.url + "/dashboard/state", **kw)
    assert response.status_code == 200, response.text
    return dict(response.json())


async def _first_frames(url: str, n: int, cookies: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The first ``n`` frames of the SSE stream."""
    frames: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=30, cookies=cookies) as client, client.stream("GET", url) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                frames.append(json.loads(line[len("data: "):]))
                if len(frames) == n:
                    break
    return frames


async def test_the_page_and_its_assets_are_served_from_the_package(settings: Settings, swarms: Swarms) -> None:
    swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)])
    async with httpx.AsyncClient(timeout=30) as client:
        page = await client.get(swarm.url + "/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        for asset, kind in (("dashboard.js", "javascript"), ("dashboard.css", "css")):
            assert f"/dashboard/static/{asset}" in page.text
            served = await client.get(f"{swarm.url}/dashboard/static/{asset}")
            assert served.status_code == 200 and kind in served.headers["content-type"] and served.content
        missing = await client.get(swarm.url + "/dashboard/static/secret.py")
        assert missing.status_code == 404 and "secret.py" in missing.json()["error"]["message"]
        # no asset comes from elsewhere (no CDN): every script and stylesheet is a path of this gateway
        assert "http://" not in page.text and "https://" not in page.text


async def test_the_stream_shows_coverage_a_live_session_with_its_route_and_the_link_rtts(
        settings: Settings, swarms: Swarms) -> None:
    swarm = await swarms.start(settings, [stub(0, 4, delay_s=0.01), stub(4, 8, delay_s=0.01)])
    frames = await _first_frames(swarm.url + "/dashboard/events", 1)
    model = frames[0]["models"][0]
    assert model["id"] == STUB_MODEL and model["complete"] and model["missing"] == []
    assert [layer["serving"] for layer in model["layers"]] == [["n1"]] * 4 + [["n2"]] * 4

    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="none", max_retries=0)
    stream = await client.completions.create(model=STUB_MODEL, prompt="hello", max_tokens=2000, stream=True,
                                             extra_body={"ignore_eos": True})
    sid = ""
    async with httpx.AsyncClient(timeout=30) as http:
        async for chunk in stream:
            sid = sid or (chunk.model_extra or {}).get("swarmroute", {}).get("session_id", "")
            shown = [s for s in (await _state(http, swarm))["sessions"] if s["session_id"] == sid]
            if shown and shown[0]["phase"] == "decode":
                break
        else:
            pytest.fail("the session never showed as decoding while it streamed")
        session = shown[0]
        assert [(h["node_id"], h["layers"]) for h in session["route"]] == [("n1", [0, 4]), ("n2", [4, 8])]
        # the nodes measured the link they route over, and advertised it

        async def measured() -> dict[str, Any] | None:
            s = await _state(http, swarm)
            links = s["links"]
            return s if links["nodes"] == ["n1", "n2"] and all(
                links["rtt_ms"][i][j] for i, j in ((0, 1), (1, 0))) else None

        # the stream stays open meanwhile: a node measures the peers of its open sessions, at its next probe round
        state = await eventually(measured, timeout=20, interval=0.2, what="the n1/n2 link measured both ways")
        await stream.close()
        assert all(0 < state["links"]["rtt_ms"][i][j] < 5000 for i, j in ((0, 1), (1, 0)))
        node = next(n for n in state["nodes"] if n["node_id"] == "n1")
        assert node["rss_bytes"] > 0 and node["compute_ms_per_layer"] is not None


async def test_a_node_leaving_turns_the_model_incomplete_and_is_an_event(settings: Settings, swarms: Swarms) -> None:
    swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)])
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await _state(http, swarm))["models"][0]["complete"]
        await swarm.nodes[1].stop()

        async def incomplete() -> dict[str, Any] | None:
            state = await _state(http, swarm)
            return state if not state["models"][0]["complete"] else None

        state = await eventually(incomplete, timeout=10, interval=0.1, what="the model incomplete")
        assert state["models"][0]["missing"] == ["[4, 8)"]
        assert any("node n2 left" in e["text"] for e in state["events"]), state["events"]


@pytest.fixture
def keyed(nats_server: EmbeddedNats, tmp_path: Path) -> Settings:
    return make_settings(nats_server.url, tmp_path / "home", api_keys=[KEY])


async def test_with_api_keys_a_browser_signs_in_and_the_stream_takes_the_cookie(keyed: Settings,
                                                                               swarms: Swarms) -> None:
    swarm = await swarms.start(keyed, [stub(0, 8)])
    async with httpx.AsyncClient(timeout=30) as http:
        page = await http.get(swarm.url + "/dashboard")
        assert page.status_code == 303 and page.headers["location"] == "/dashboard/login"
        for path in ("/dashboard/events", "/dashboard/state"):
            refused = await http.get(swarm.url + path)
            assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"], path
        form = await http.get(swarm.url + "/dashboard/login")
        assert form.status_code == 200 and 'name="key"' in form.text
        wrong = await http.post(swarm.url + "/dashboard/login", data={"key": "sk-wrong"})
        assert wrong.status_code == 401 and "not one of this gateway's API keys" in wrong.text
        assert COOKIE not in wrong.cookies
        signed = await http.post(swarm.url + "/dashboard/login", data={"key": KEY})
        assert signed.status_code == 303 and signed.headers["location"] == "/dashboard"
        cookie = signed.cookies[COOKIE]
        assert KEY not in cookie and "httponly" in signed.headers["set-cookie"].lower()
    frames = await _first_frames(swarm.url + "/dashboard/events", 1, cookies={COOKIE: cookie})
    assert frames[0]["models"][0]["complete"]
    async with httpx.AsyncClient(timeout=30, cookies={COOKIE: cookie}) as http:
        assert (await http.get(swarm.url + "/dashboard")).status_code == 200
    async with httpx.AsyncClient(timeout=30, cookies={COOKIE: "0" * 64}) as http:
        assert (await http.get(swarm.url + "/dashboard/state")).status_code == 401
    async with httpx.AsyncClient(timeout=30) as http:
        bearer = await http.get(swarm.url + "/dashboard/state", headers={"authorization": f"Bearer {KEY}"})
        assert bearer.status_code == 200
        # the rest of the API still takes the key as before
        assert (await http.get(swarm.url + "/v1/models")).status_code == 401
        assert (await http.get(swarm.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})).is_success


async def test_a_gateway_without_keys_needs_no_sign_in(settings: Settings, swarms: Swarms) -> None:
    swarm = await swarms.start(settings, [stub(0, 8)])
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.get(swarm.url + "/dashboard")).status_code == 200
        signed = await http.post(swarm.url + "/dashboard/login", data={"key": "anything"})
        assert signed.status_code == 303 and COOKIE not in signed.cookies
