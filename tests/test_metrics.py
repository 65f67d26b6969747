"""Prometheus /metrics on the gateway and on nodes, parsed with prometheus_client's own parser, checked against
what the test itself observed (tokens received, wall time, the backends' own counters)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import httpx
import openai
from pydantic import SecretStr

from actors.node.metrics import count_artifact_fetched, count_artifact_served
from gateway.app import Gateway
from schemas.session import Prompt
from schemas.settings import Settings
from tests.support.prometheus import Scrape
from tests.support.swarm import Swarms, stub
from tests.support.waiting import eventually


async def scrape(url: str, headers: dict[str, str] | None = None) -> Scrape:
    async with httpx.AsyncClient() as client:
        r = await client.get(f"{url}/metrics", headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


async def at_zero(url: str, gauge: str) -> Scrape | None:
    """A scrape of ``url`` if ``gauge`` reads 0 there (sessions are freed just after the last event went out)."""
    result = await scrape(url)
    return result if result.value(gauge) == 0 else None


def _has(names: set[str], wanted: Iterable[str]) -> None:
    missing = sorted(set(wanted) - names)
    assert not missing, f"missing series: {missing}"


async def test_metrics_after_a_streamed_request(settings: Settings, swarms: Swarms) -> None:
    head, tail = stub(0, 4, delay_s=0.002), stub(4, 8)
    polling = settings.model_copy(update={"hop_spin_grace_s": 0.002})  # opt-in: its metric is one of the series
    swarm = await swarms.start(polling, [head, tail], model_id="stub-model")
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    n_tokens = 20
    started = time.monotonic()
    stream = await client.completions.create(model="stub-model", prompt="metrics please", max_tokens=n_tokens,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen = 0
    mid_node: Scrape | None = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            seen += 1
        if seen == 5 and mid_node is None:
            mid_node = await scrape(swarm.nodes[0].endpoint)
            kv_now = head.kv_bytes_in_use()
    wall = time.monotonic() - started
    prompt_tokens = len(head.tokenize(Prompt(text="metrics please")))

    # mid-stream: one live session holding KV, as the backend itself counts it
    assert mid_node is not None
    assert mid_node.value("swarmroute_node_live_sessions") == 1
    assert 0 < mid_node.value("swarmroute_node_kv_bytes") <= kv_now

    # The client stops reading at [DONE]; the gateway and the nodes free the session just after: wait for it.
    gw = await eventually(lambda: at_zero(swarm.url, "swarmroute_gateway_live_sessions"), timeout=5.0,
                          interval=0.02, what="the gateway's live sessions reading 0")
    await eventually(lambda: at_zero(swarm.nodes[0].endpoint, "swarmroute_node_live_sessions"), timeout=5.0,
                     interval=0.02, what="the head's live sessions reading 0")
    _has(gw.names(), ["swarmroute_gateway_" + n for n in (
        "requests_total", "sessions_total", "ttft_seconds_count", "time_per_output_token_seconds_count",
        "live_sessions", "hop_compute_seconds_count", "hop_overhead_seconds_count", "session_seconds_count",
        "prompt_tokens_total", "completion_tokens_total")])
    assert gw.value("swarmroute_gateway_requests_total", endpoint="/v1/completions", status="200") == 1
    assert gw.value("swarmroute_gateway_sessions_total", outcome="complete") == 1
    assert gw.value("swarmroute_gateway_live_sessions") == 0
    assert gw.value("swarmroute_gateway_completion_tokens_total") == n_tokens == seen
    assert gw.value("swarmroute_gateway_prompt_tokens_total") == prompt_tokens
    assert gw.value("swarmroute_gateway_ttft_seconds_count") == 1
    ttft = gw.value("swarmroute_gateway_ttft_seconds_sum")
    tpot_sum = gw.value("swarmroute_gateway_time_per_output_token_seconds_sum")
    assert gw.value("swarmroute_gateway_time_per_output_token_seconds_count") == n_tokens - 1
    assert 0 < ttft < wall and 0 < tpot_sum < wall and ttft + tpot_sum <= wall
    assert gw.labels("swarmroute_gateway_hop_compute_seconds_count", "node") == {"n1", "n2"}

    node1, node2 = await scrape(swarm.nodes[0].endpoint), await scrape(swarm.nodes[1].endpoint)
    _has(node1.names(), ["swarmroute_node_" + n for n in (
        "sessions_opened_total", "sessions_ended_total", "step_seconds_count", "queue_seconds_count",
        "hop_seconds_count", "link_overhead_seconds_count", "ttft_seconds_count",
        "time_per_output_token_seconds_count", "live_sessions", "max_sessions", "kv_bytes",
        "frame_bytes_received_total", "hop_spin_seconds_total")])
    assert node1.value("swarmroute_node_sessions_opened_total", role="head") == 1
    assert node2.value("swarmroute_node_sessions_opened_total", role="tail") == 1
    assert node1.value("swarmroute_node_sessions_ended_total", outcome="complete") == 1
    assert node1.value("swarmroute_node_live_sessions") == 0 and node1.value("swarmroute_node_kv_bytes") == 0
    assert node1.value("swarmroute_node_max_sessions") == head.max_sessions
    # the head computes the prompt in chunks then one position per token but the last; the tail the same
    chunks = math.ceil(prompt_tokens / settings.prefill_chunk)
    assert node1.value("swarmroute_node_step_seconds_count", kind="prefill") == chunks
    assert node1.value("swarmroute_node_step_seconds_count", kind="decode") == n_tokens - 1
    # every step the head computes leaves as a frame to n2; every token the tail samples goes back to n1
    assert node1.value("swarmroute_node_hop_seconds_count", peer="n2", kind="frame") == chunks + n_tokens - 1
    assert node2.value("swarmroute_node_hop_seconds_count", peer="n1", kind="token") == n_tokens
    assert node1.value("swarmroute_node_ttft_seconds_count") == 1
    assert node1.value("swarmroute_node_time_per_output_token_seconds_count") == n_tokens - 1
    assert node1.value("swarmroute_node_link_overhead_seconds_count") == n_tokens - 1
    # the stub head sleeps 2 ms per step: its compute histogram cannot be faster than that
    assert node1.value("swarmroute_node_step_seconds_sum", kind="decode") >= 0.002 * (n_tokens - 1)
    hidden = 64 * 4  # one f32 position of the stub's (64,) hidden state
    assert node2.value("swarmroute_node_frame_bytes_received_total") > hidden * (prompt_tokens + n_tokens - 1)
    # the nodes polled between decode steps (actors/node/spin.py): each for part of the session at most (its last
    # stretch may outlast the stream by a step plus the grace)
    node2 = await eventually(lambda: at_zero(swarm.nodes[1].endpoint, "swarmroute_node_live_sessions"),
                             timeout=5.0, interval=0.02, what="the tail's live sessions reading 0")
    polled = [n.value("swarmroute_node_hop_spin_seconds_total") for n in (node1, node2)]
    assert sum(polled) > 0 and all(0 <= p < wall + 0.05 for p in polled), (polled, wall)


async def test_artifact_counters_and_refused_requests_are_counted(settings: Settings, swarms: Swarms) -> None:
    swarm = await swarms.start(settings, [stub()], model_id="stub-model")
    keyed = await swarms.actor(Gateway(settings.model_copy(update={"api_keys": [SecretStr("sk-1")]}), port=0))
    before = await scrape(swarm.nodes[0].endpoint)
    fetched0 = sum(s.value for s in before.samples if s.name == "swarmroute_artifact_bytes_fetched_total")
    count_artifact_fetched(1000, "m1")
    count_artifact_fetched(24, "m1")
    count_artifact_served(512, "m1")
    after = await scrape(swarm.nodes[0].endpoint)
    assert after.value("swarmroute_artifact_bytes_fetched_total", model="m1") - fetched0 == 1024
    assert after.value("swarmroute_artifact_bytes_served_total", model="m1") >= 512

    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{keyed.url}/v1/models")).status_code == 401
        assert (await client.get(f"{keyed.url}/no/such/path")).status_code in (401, 404)
        assert (await client.get(f"{keyed.url}/metrics")).status_code == 401  # metrics sit behind the keys too
    gw = await scrape(keyed.url, headers={"authorization": "Bearer sk-1"})
    assert gw.value("swarmroute_gateway_requests_total", endpoint="/v1/models", status="401") == 1
    assert gw.value("swarmroute_gateway_requests_total", endpoint="other") == 1  # unknown paths: one series
    assert gw.value("swarmroute_gateway_requests_total", endpoint="/metrics", status="401") == 1
