"""Nodes on separate hosts (network namespaces on this machine): nothing may assume localhost."""

from __future__ import annotations

import struct
from pathlib import Path

import openai
import pytest

from actors.tracker import Tracker
from bus.capability import session_token_of
from bus.identity import load_or_create
from bus.server import EmbeddedNats, NatsServerConfig
from gateway.app import Gateway
from schemas.route import Route
from tests.support import netns
from tests.support.llama_reference import greedy_completion, id_triples
from tests.support.relay import RecordingRelay
from tests.support.swarm import Swarms, make_settings, wait_model
from tests.test_tls import SECRET

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(not netns.available(), reason="needs root and ip netns (CI machines have both)")]

MODEL = "stub-model"


async def test_stub_route_across_three_hosts(tmp_path):  # type: ignore[no-untyped-def]
    # Everything started is stopped inside the hosts' namespaces, before they go.
    with netns.hosts(3) as (bridge, hosts):
        async with Swarms() as swarms:
            server = EmbeddedNats(NatsServerConfig(store_dir=tmp_path / "nats", host=bridge)).start()
            swarms.on_teardown(server.stop)
            # Plain HTTP, explicitly (issue #29): nodes off loopback serve TLS unless told not to.
            settings = make_settings(server.url, tmp_path / "home", tls="off")
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


PROMPT, N = "The capital of France is", 16
NODE_PORT = 18000
"""Each node's port inside its own namespace: free there whatever the machine runs, so its relay can be started
(and the node told to advertise the relay) before the node itself."""


@pytest.fixture(scope="module")
def reference(gemma_path: Path) -> tuple[str, list[int], list[int]]:
    """llama-cpp-python's own greedy text of ``PROMPT`` on the whole file, the prompt's ids and the generated ids."""
    return greedy_completion(gemma_path, PROMPT, N)


def _token_frames(ids: list[int]) -> list[bytes]:
    """Each sampled token as its token frame carries it (bus/frame.py): ``seq, token id``, ``<I`` each (8 bytes)."""
    return [struct.pack("<2I", seq, token) for seq, token in enumerate(ids)]


@pytest.mark.slow
@pytest.mark.parametrize("tls", ["on", "off"])
async def test_gguf_route_across_two_hosts_is_exact_and_tls_hides_it_from_the_path(
        tmp_path: Path, gemma_path: Path, reference: tuple[str, list[int], list[int]], tls: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two real llama.cpp nodes on separate hosts, each with its own artifact store, every data-plane connection
    (gateway -> head, head -> tail, tail -> head) through a relay on the path that records the bytes both ways.
    The route's greedy text equals llama-cpp-python's own on the whole file. Over TLS (issue #29) the capture holds
    neither the prompt's text, nor its token ids as the frames encode them, nor the session token; the same capture
    of the same route in clear holds all three (what the TLS assertions would catch)."""
    expected, prompt_ids, generated = reference
    with netns.hosts(2, subnet=214) as (bridge, hosts):
        async with Swarms() as swarms:
            server = EmbeddedNats(NatsServerConfig(store_dir=tmp_path / "nats", host=bridge)).start()
            swarms.on_teardown(server.stop)
            # With TLS the nodes serve it (off loopback) and admit the gateway's key, named to them.
            gateway_cert = load_or_create(tmp_path / "home" / "identity", "gateway").cert_file
            common: dict[str, object] = dict(token_timeout_s=60.0, first_token_timeout_s=120.0, hop_timeout_s=60.0,
                                             tls=tls, tls_trusted_certs=gateway_cert, swarm_secret=SECRET)
            settings = make_settings(server.url, tmp_path / "home", **common)
            scheme = "https" if tls == "on" else "http"
            relays = []
            for i, ((ns, address), layers) in enumerate(zip(hosts, ["0:9", "9:18"], strict=True)):
                relay = await RecordingRelay.start((address, NODE_PORT), listen_host=bridge)
                swarms.on_teardown(relay.stop)
                relays.append(relay)
                await swarms.node_process(make_settings(server.url, tmp_path / f"host{i}", **common), f"gguf{i}", [
                    "--backend", "llamacpp", "--model", str(gemma_path), "--layers", layers, "--threads", "1",
                    "--model-id", "gemma", "--host", address, "--port", str(NODE_PORT),
                    "--advertise-url", f"{scheme}://{bridge}:{relay.port}"], prefix=["ip", "netns", "exec", ns])
            tracker = await swarms.actor(Tracker(settings))
            tokens: list[str] = []
            hand_out = tracker._hand_out

            def recording(route: Route, link: str | None = None) -> Route:
                out = hand_out(route, link)
                tokens.append(session_token_of(out) or "")
                return out

            monkeypatch.setattr(tracker, "_hand_out", recording)
            gateway = await swarms.actor(Gateway(settings, port=0))
            await wait_model(tracker, "gemma", timeout=60, n_nodes=2)
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            result = await client.completions.create(model="gemma", prompt=PROMPT, max_tokens=N, temperature=0)
            route = result.model_extra["swarmroute"]["route"]  # type: ignore[index]
    assert result.choices[0].text == expected
    assert [h["node_id"] for h in route] == ["gguf0", "gguf1"]
    assert len(tokens) == 1 and len(tokens[0]) >= 16
    head, tail = (r.captured for r in relays)
    assert len(tail) > N * 640 * 4  # every decode step's activations crossed head -> tail through the relay
    seen = {"prompt": PROMPT.encode() in head + tail, "session token": tokens[0].encode() in head + tail,
            # This route's frames carry the generated ids (token frames); its prefill frames carry no ids (the
            # prompt reaches the head in the gateway's requests: "prompt"); a frame flagged with its ids shows rows.
            "token ids": any(p in head + tail for p in id_triples(prompt_ids) + _token_frames(generated))}
    assert seen == dict.fromkeys(seen, tls == "off")
