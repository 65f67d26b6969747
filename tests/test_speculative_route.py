"""Speculative decoding across a route (issue #20) on the stub backend, which computes exactly: verify windows of
prompt-lookup drafts give the very text plain decoding gives, through 2- and 3-node routes, with windows in flight
and rejections; every hop's KV ends holding exactly the accepted positions."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from schemas.settings import Settings
from tests.support.prometheus import Scrape
from tests.support.swarm import Swarm, Swarms, make_settings, stub

MODEL = "stub-model"


def spec_settings(nats_url: str, home: Any, **kw: Any) -> Settings:
    return make_settings(nats_url, home, prefill_chunk=16, prefix_cache_mb=0, **kw)


async def complete(swarm: Swarm, prompt: str, max_tokens: int, **kw: Any) -> tuple[str, dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                            extra_body={"ignore_eos": True}, **kw)
    return reply.choices[0].text, (reply.model_extra or {})["swarmroute"]


@pytest.mark.parametrize("cuts", [[0, 4, 8], [0, 3, 6, 8]], ids=["2-node", "3-node"])
@pytest.mark.parametrize("windows", [1, 3])
async def test_greedy_with_speculation_is_greedy_without(nats_server: Any, tmp_path: Any, swarms: Swarms,
                                                        cuts: list[int], windows: int) -> None:
    def backends() -> list[Any]:
        return [stub(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]

    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on"
    plain = await swarms.start(spec_settings(nats_server.url, tmp_path / "plain", namespace="plain"), backends())
    expected, _ = await complete(plain, prompt, 80, temperature=0)
    spec = await swarms.start(spec_settings(nats_server.url, tmp_path / "spec", namespace="spec",
                                            speculation="ngram", speculative_windows=windows), backends())
    text, telemetry = await complete(spec, prompt, 80, temperature=0)
    assert text == expected
    view = telemetry["speculation"]
    assert view["source"] == "ngram" and view["windows"] > 0 and view["drafts_offered"] > 0, view
    await spec.freed()
    series = Scrape(spec.nodes[0].metrics.render().decode())
    # Sent counts every window (those with no drafts, and stale ones dropped unjudged); the view, judged drafts.
    assert series.value("swarmroute_node_spec_windows_total", source="ngram") >= view["windows"]
    assert series.value("swarmroute_node_spec_accepted_drafts_count", source="ngram") == view["windows"]
    accepted = series.value("swarmroute_node_spec_drafts_total", source="ngram", outcome="accepted")
    rejected = series.value("swarmroute_node_spec_drafts_total", source="ngram", outcome="rejected")
    assert (accepted, accepted + rejected) == (view["drafts_accepted"], view["drafts_offered"])
    assert series.value("swarmroute_node_spec_accepted_drafts_sum", source="ngram") == accepted
    assert series.value("swarmroute_node_spec_windows_in_flight") == 0, "the session ended: nothing in flight"


async def test_a_seeded_sampled_stream_with_speculation_is_reproducible(nats_server: Any, tmp_path: Any,
                                                                       swarms: Swarms) -> None:
    settings = spec_settings(nats_server.url, tmp_path / "h", speculation="ngram", speculative_windows=2)
    swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)])
    prompt = "abab abab abab abab"
    first, _ = await complete(swarm, prompt, 60, temperature=0.9, seed=5)
    again, telemetry = await complete(swarm, prompt, 60, temperature=0.9, seed=5)
    assert first == again and len(first) == 60
    assert telemetry["speculation"]["windows"] > 0


async def test_torch_routes_speculate_with_zero_flips(nats_server: Any, tmp_path: Any, swarms: Swarms) -> None:
    """The reference backend computes each position exactly whatever the window's shape: zero flips. The drafts
    come from the same tiny model loaded whole on the head (a draft model that is always right when greedy), so
    every window carries drafts."""
    from actors.backends.torch.backend import load_torch
    from actors.node import Node, NodeConfig
    from actors.tracker import Tracker
    from gateway.app import Gateway
    from tests.support.torch_route import build_route

    prompt = "one two three four one two three four one two three"
    plain = await swarms.start(spec_settings(nats_server.url, tmp_path / "p", namespace="tplain"),
                               build_route("tiny-llama", (0, 3, 6)), model_id="tiny-llama")
    expected, _ = await _complete_model(plain, "tiny-llama", prompt, 40)
    settings = spec_settings(nats_server.url, tmp_path / "s", namespace="tspec", speculation="model",
                             speculative_windows=2, speculative_max_k=4)
    head, tail = build_route("tiny-llama", (0, 3, 6))
    await swarms.actor(Tracker(settings))
    await swarms.actor(Node(NodeConfig(node_id="h", model_id="tiny-llama"), head, settings,
                            draft=load_torch(model="tiny-llama")))
    await swarms.actor(Node(NodeConfig(node_id="t", model_id="tiny-llama"), tail, settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    await _wait_routable(client)
    reply = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=40, temperature=0,
                                            extra_body={"ignore_eos": True})
    view = (reply.model_extra or {})["swarmroute"]["speculation"]
    assert reply.choices[0].text == expected
    assert view["source"] == "model" and view["drafts_offered"] > 0 and view["acceptance"] == 1.0, view


async def _wait_routable(client: openai.AsyncOpenAI) -> None:
    from tests.support.waiting import eventually

    await eventually(lambda: client.completions.create(model="tiny-llama", prompt="x", max_tokens=1),
                     ignoring=(openai.APIStatusError,), what="the speculative route serving")


async def _complete_model(swarm: Swarm, model: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    reply = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
    return reply.choices[0].text, (reply.model_extra or {})["swarmroute"]


class CountingStub:
    """A stub backend that checks, after every step and every cut, that each layer's KV holds exactly as many
    positions as the session is at (a cut that moved the position but kept rejected drafts' KV would fail)."""

    def __init__(self, start: int, end: int) -> None:
        self.inner = stub(start, end)
        self.violations: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _check(self, what: str) -> None:
        for sid in self.inner.open_sessions:
            if not self.inner.kv_continues(sid):
                self.violations.append(f"{what}: session {sid[:8]} holds other than its position")

    def step(self, batch: list[Any]) -> list[Any]:
        out = self.inner.step(batch)
        self._check("step")
        return out

    def truncate(self, session_id: str, position: int) -> None:
        self.inner.truncate(session_id, position)
        self._check("truncate")


class WrongDrafts:
    """Prompt lookup whose every third draft is replaced by a token the model will not pick: windows are rejected
    in the middle, often with windows behind them in flight."""

    name = "ngram"

    def __init__(self) -> None:
        from actors.node.speculation.drafts import NgramDraft

        self._inner = NgramDraft()
        self._n = 0

    async def propose(self, history: Any, k: int) -> list[int]:
        drafts = await self._inner.propose(history, k)
        out = []
        for d in drafts:
            self._n += 1
            out.append(7 if self._n % 3 == 0 else d)  # a control byte the stub never samples
        return out

    async def close(self) -> None:
        return None


async def test_rejected_windows_with_windows_in_flight_leave_exactly_the_accepted_positions(
        nats_server: Any, tmp_path: Any, swarms: Swarms) -> None:
    from actors.backend import KvBackend

    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on"
    plain = await swarms.start(spec_settings(nats_server.url, tmp_path / "plain", namespace="cplain"),
                               [stub(0, 3), stub(3, 6), stub(6, 8)])
    expected, _ = await complete(plain, prompt, 80, temperature=0)
    hops = [CountingStub(0, 3), CountingStub(3, 6), CountingStub(6, 8)]
    assert all(isinstance(h, KvBackend) for h in hops)
    spec = await swarms.start(spec_settings(nats_server.url, tmp_path / "spec", namespace="cspec",
                                            speculation="ngram", speculative_windows=3), hops)  # type: ignore[list-item]
    runtime = spec.nodes[0].runtime
    assert runtime is not None
    runtime.drafts = lambda session_id, source: WrongDrafts()
    text, telemetry = await complete(spec, prompt, 80, temperature=0)
    view = telemetry["speculation"]
    assert text == expected
    assert view["drafts_offered"] > view["drafts_accepted"] > 0, view  # rejections happened, and acceptances
    assert all(not h.violations for h in hops), [h.violations[:3] for h in hops]


async def test_a_node_lost_mid_window_fails_the_session_naming_it(nats_server: Any, tmp_path: Any,
                                                                 swarms: Swarms) -> None:
    """Speculative sessions do not repair (their KV goes back and forth between windows): the loss is the
    structured failure of alpha, naming the node and the phase."""
    from actors.tracker import Tracker
    from gateway.app import Gateway
    from tests.support.swarm import wait_model

    settings = spec_settings(nats_server.url, tmp_path / "home", speculation="ngram", speculative_windows=2,
                             token_timeout_s=3.0, hop_timeout_s=2.0)
    args = ["--backend", "stub", "--model", MODEL, "--n-layers", "8", "--stub-delay", "0.01"]
    await swarms.node_process(settings, "head", [*args, "--layers", "0:4"])
    tail = await swarms.node_process(settings, "tail", [*args, "--layers", "4:8"])
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=2)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt="abab abab abab abab abab", max_tokens=400,
                                             stream=True, temperature=0, extra_body={"ignore_eos": True})
    seen = 0
    with pytest.raises(openai.APIError) as failure:
        async for chunk in stream:
            seen += bool(chunk.choices and chunk.choices[0].text)
            if seen == 10:
                tail.kill()
    body = failure.value.body if isinstance(failure.value.body, dict) else {}
    assert body.get("failure", {}).get("node_id") == "tail" and body["failure"]["phase"] == "decode", body
