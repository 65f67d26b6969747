"""Nodes on separate hosts (network namespaces on this machine): nothing may assume localhost."""

from __future__ import annotations

import openai
import pytest

from actors.tracker import Tracker
from bus.server import EmbeddedNats, NatsServerConfig
from gateway.app import Gateway
from tests.support import netns
from tests.support.swarm import Swarms, make_settings, wait_model

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(not netns.available(), reason="needs root and ip netns (CI machines have both)")]

MODEL = "stub-model"


async def test_stub_route_across_three_hosts(tmp_path):  # type: ignore[no-untyped-def]
    # Everything started is stopped inside the hosts' namespaces, before they go.
    with netns.hosts(3) as (bridge, hosts):
        async with Swarms() as swarms:
            server = EmbeddedNats(NatsServerConfig(store_dir=tmp_path / "nats", host=bridge)).start()
            swarms.on_teardown(server.stop)
            settings = make_settings(server.url, tmp_path / "home")
            ranges = ["0:3", "3:6", "6:8"]
            procs = []
            for i, ((ns, address), layers) in enumerate(zip(hosts, ranges, strict=True)):
                procs.append(await swarms.node_process(settings, f"host{i}", [
                    "--backend", "stub", "--model", MODEL, "--layers", layers, "--n-layers", "8", "--host", address],
                    prefix=["ip", "netns", "exec", ns]))
            assert [p.endpoint for p in procs] == [f"http://{a}:{p.endpoint.rsplit(':', 1)[1]}"  # type: ignore[union-attr]
                                                   for (_, a), p in zip(hosts, procs, strict=True)]
            tracker = await swarms.actor(Tracker(settings))
            gateway = await swarms.actor(Gateway(settings, port=0))
            await wait_model(tracker, MODEL, n_nodes=3)
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
            result = await client.completions.create(model=MODEL, prompt="across hosts", max_tokens=16,
                                                     temperature=0, extra_body={"ignore_eos": True})
            assert result.usage is not None and result.usage.completion_tokens == 16
            route = result.model_extra["swarmroute"]["route"]  # type: ignore[index]
            assert [h["node_id"] for h in route] == ["host0", "host1", "host2"]


@pytest.mark.slow
async def test_gguf_route_across_two_hosts_equals_llama_cpp(tmp_path, gemma_path):  # type: ignore[no-untyped-def]
    """Two real llama.cpp nodes on separate hosts, each with its own artifact store: the route's greedy text equals
    llama-cpp-python's own on the whole file."""
    import llama_cpp

    prompt, n = "The capital of France is", 24
    llm = llama_cpp.Llama(str(gemma_path), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    expected = llm.create_completion(prompt, max_tokens=n, temperature=0.0)["choices"][0]["text"]  # type: ignore[index]
    llm.close()
    with netns.hosts(2, subnet=214) as (bridge, hosts):
        async with Swarms() as swarms:
            server = EmbeddedNats(NatsServerConfig(store_dir=tmp_path / "nats", host=bridge)).start()
            swarms.on_teardown(server.stop)
            settings = make_settings(server.url, tmp_path / "home", token_timeout_s=60.0,
                                     first_token_timeout_s=120.0, hop_timeout_s=60.0)
            for i, ((ns, address), layers) in enumerate(zip(hosts, ["0:9", "9:18"], strict=True)):
                host_settings = make_settings(server.url, tmp_path / f"host{i}")  # a separate store per host
                await swarms.node_process(host_settings, f"gguf{i}", [
                    "--backend", "llamacpp", "--model", str(gemma_path), "--layers", layers, "--threads", "1",
                    "--model-id", "gemma", "--host", address], prefix=["ip", "netns", "exec", ns])
            tracker = await swarms.actor(Tracker(settings))
            gateway = await swarms.actor(Gateway(settings, port=0))
            await wait_model(tracker, "gemma", timeout=60, n_nodes=2)
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            result = await client.completions.create(model="gemma", prompt=prompt, max_tokens=n, temperature=0)
            assert result.choices[0].text == expected
            route = result.model_extra["swarmroute"]["route"]  # type: ignore[index]
            assert [h["node_id"] for h in route] == ["gguf0", "gguf1"]
