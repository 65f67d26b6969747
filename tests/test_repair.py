"""Sessions that survive a lost node (issue #18), on the stub backend with real node processes, a real tracker,
gateway and nats-server, and the official client: a SIGKILLed hop is replaced and the stream goes on with the very
tokens an undisturbed run gives (the stub's arithmetic is exact, so any KV rebuilt wrongly shows in the text)."""

from __future__ import annotations

import time

import openai
import pytest

from actors.tracker import Tracker
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.swarm import NodeProcess, Swarms, make_settings, wait_model

MODEL = "stub-model"


def stub_args(layers: str, delay: float) -> list[str]:
    return ["--backend", "stub", "--model", MODEL, "--layers", layers, "--n-layers", "8", "--stub-delay", str(delay)]


@pytest.fixture
def repair_settings(nats_server: object, tmp_path: object) -> Settings:
    return make_settings(nats_server.url, tmp_path / "home", token_timeout_s=3.0,  # type: ignore[attr-defined,operator]
                         first_token_timeout_s=5.0, hop_timeout_s=2.0, prefill_chunk=4, snapshot_every=8,
                         repair_timeout_s=15.0)


async def _stream(base_url: str, *, prompt: str, max_tokens: int, kill: dict[str, NodeProcess] | None = None,
                  hop: int = 0, after_tokens: int = 0, in_prefill: int = 0,
                  seed: int | None = None) -> tuple[str, list[dict]]:
    """The streamed text and every telemetry snapshot; the node at hop ``hop`` of the session's route (one of
    ``kill``) is SIGKILLed after ``after_tokens`` tokens (or, with ``in_prefill``, once that many prompt positions
    went through)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0 if seed is None else 1.0,
        seed=seed, extra_body={"ignore_eos": True, "stream_options": {"include_telemetry": True}})
    text, snaps, seen, killed = "", [], 0, False
    async for chunk in stream:
        snap = (chunk.model_extra or {}).get("swarmroute")
        if snap:
            snaps.append(snap)
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            seen += 1
        due = (in_prefill and snap and snap.get("phase") == "prefill" and snap["prefill"]["done"] >= in_prefill) \
            or (not in_prefill and after_tokens and seen >= after_tokens)
        if kill is not None and not killed and due:
            kill[snaps[0]["route"][hop]["node_id"]].kill()
            killed = True
    assert kill is None or killed
    return text, snaps


async def _three_hops(settings: Settings, swarms: Swarms, delay: float = 0.005) -> dict[str, NodeProcess]:
    nodes = {name: await swarms.node_process(settings, name, stub_args(layers, delay))
             for name, layers in [("head", "0:3"), ("middle", "3:6"), ("tail", "6:8")]}
    return nodes


@pytest.mark.parametrize("victim", ["middle", "tail"])
async def test_a_killed_hop_is_replaced_and_the_stream_goes_on_unchanged(repair_settings: Settings, swarms: Swarms,
                                                                         victim: str) -> None:
    nodes = await _three_hops(repair_settings, swarms)
    tracker = await swarms.actor(Tracker(repair_settings))
    gateway = await swarms.actor(Gateway(repair_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=3)
    prompt = "the quick brown fox jumps over the lazy dog"
    expected, _ = await _stream(gateway.url + "/v1", prompt=prompt, max_tokens=60)
    hop = 1 if victim == "middle" else 2
    nodes["spare"] = await swarms.node_process(repair_settings, "spare", stub_args(["3:6", "6:8"][hop - 1], 0.005))
    await wait_model(tracker, MODEL, n_nodes=4)
    started = time.monotonic()
    text, snaps = await _stream(gateway.url + "/v1", prompt=prompt, max_tokens=60, kill=nodes, hop=hop,
                                after_tokens=20)
    assert text == expected
    phases = [s["phase"] for s in snaps]
    assert "repairing" in phases and phases[-1] == "complete", phases
    repair = snaps[-1]["repair"]
    lost = snaps[0]["route"][hop]["node_id"]
    other = ({victim, "spare"} - {lost}).pop()
    assert repair["lost_node"] == lost and repair["replacement"] == [other], repair
    assert repair["source"] == "snapshot" and repair["snapshot_positions"] > 0, repair
    assert [h["node_id"] for h in snaps[-1]["route"]][hop] == other
    assert time.monotonic() - started < 30


async def test_a_hop_killed_in_prefill_is_rebuilt_from_the_journal(repair_settings: Settings, swarms: Swarms) -> None:
    """No snapshot exists before prefill ends: the hop before the lost one replays every chunk it computed, and
    the tokens are those of an undisturbed run. (Prefix reuse off: the undisturbed run would leave the prompt's KV
    for the second to reuse, and its prefill would be one chunk.)"""
    repair_settings = repair_settings.model_copy(update={"prefix_cache_mb": 0.0})
    nodes = await _three_hops(repair_settings, swarms, delay=0.03)
    tracker = await swarms.actor(Tracker(repair_settings))
    gateway = await swarms.actor(Gateway(repair_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=3)
    prompt = "p" * 120
    expected, _ = await _stream(gateway.url + "/v1", prompt=prompt, max_tokens=12)
    nodes["spare"] = await swarms.node_process(repair_settings, "spare", stub_args("3:6", 0.03))
    await wait_model(tracker, MODEL, n_nodes=4)
    text, snaps = await _stream(gateway.url + "/v1", prompt=prompt, max_tokens=12, kill=nodes, hop=1, in_prefill=40)
    assert text == expected
    repair = snaps[-1]["repair"]
    assert repair["source"] == "journal" and repair["snapshot_positions"] == 0, repair
    assert [s["phase"] for s in snaps].count("repairing") >= 1 and snaps[-1]["phase"] == "complete"


async def test_seeded_sampling_goes_on_as_if_nothing_happened(repair_settings: Settings, swarms: Swarms) -> None:
    """A rebuilt tail draws from the seed and the position alone (stub), so even a sampled stream is unchanged."""
    nodes = await _three_hops(repair_settings, swarms)
    tracker = await swarms.actor(Tracker(repair_settings))
    gateway = await swarms.actor(Gateway(repair_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=3)
    expected, _ = await _stream(gateway.url + "/v1", prompt="seeded", max_tokens=50, seed=7)
    nodes["spare"] = await swarms.node_process(repair_settings, "spare", stub_args("6:8", 0.005))
    await wait_model(tracker, MODEL, n_nodes=4)
    text, snaps = await _stream(gateway.url + "/v1", prompt="seeded", max_tokens=50, seed=7, kill=nodes, hop=2,
                                after_tokens=15)
    assert text == expected and snaps[-1]["repair"]["source"] == "snapshot"


async def test_repair_off_keeps_alphas_fail_stop(nats_server: object, tmp_path: object, swarms: Swarms) -> None:
    settings = make_settings(nats_server.url, tmp_path / "home", token_timeout_s=3.0,  # type: ignore[attr-defined]
                             hop_timeout_s=2.0, prefill_chunk=4, repair=False)
    nodes = await _three_hops(settings, swarms)
    nodes["spare"] = await swarms.node_process(settings, "spare", stub_args("3:6", 0.005))
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=4)
    with pytest.raises(openai.APIError) as failure:
        await _stream(gateway.url + "/v1", prompt="hello", max_tokens=200, kill=nodes, hop=1, after_tokens=5)
    body = failure.value.body if isinstance(failure.value.body, dict) else {}
    assert body.get("failure", {}).get("phase") == "decode" and "repair" not in failure.value.message, body
    assert body["failure"]["node_id"] in ("middle", "spare")


async def test_a_corrupt_snapshot_is_refused_and_the_session_fails_saying_so(repair_settings: Settings,
                                                                            swarms: Swarms) -> None:
    """The standby's copy of a segment has a flipped byte: the replacement checks every segment against its
    digest, refuses it, and the session fails naming why repair was impossible (once decode has gone on, the
    journal no longer reaches back to position 0). In-process nodes, so the test can reach the standby's memory;
    the lost hop's HTTP server stops mid-stream, which is what its peers see of a crash."""
    from actors.node import Node, NodeConfig
    from tests.support.swarm import stub

    def node(name: str, start: int, end: int) -> Node:
        return Node(NodeConfig(node_id=name, model_id=MODEL), stub(start, end, model=MODEL, delay_s=0.005),
                    repair_settings)

    nodes = {name: await swarms.actor(node(name, a, b))
             for name, a, b in [("head", 0, 3), ("middle", 3, 6), ("spare", 3, 6), ("tail", 6, 8)]}
    tracker = await swarms.actor(Tracker(repair_settings))
    gateway = await swarms.actor(Gateway(repair_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=4)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt="hello there", max_tokens=200, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True,
                                                                        "stream_options": {"include_telemetry": True}})
    snaps: list[dict] = []
    seen = 0
    with pytest.raises(openai.APIError) as failure:
        async for chunk in stream:
            snap = (chunk.model_extra or {}).get("swarmroute")
            if snap:
                snaps.append(snap)
            seen += bool(chunk.choices and chunk.choices[0].text)
            if seen == 30:
                lost = nodes[snaps[0]["route"][1]["node_id"]]
                standby = nodes[({"middle", "spare"} - {lost.config.node_id}).pop()]
                chains = list(standby.snapshots._chains.values())  # noqa: SLF001 - the standby's memory rots
                assert chains, "the lost hop's standby holds no snapshot"
                chains[0].blobs[0] = bytes([chains[0].blobs[0][0] ^ 0xFF]) + chains[0].blobs[0][1:]
                await lost.server.stop()
    assert "fails its sha256" in failure.value.message and "repair impossible" in failure.value.message, \
        failure.value.message


async def test_a_session_that_reused_a_prefix_is_repaired_from_its_seeded_snapshot(repair_settings: Settings,
                                                                                  swarms: Swarms) -> None:
    """The second run of a prompt reuses the first's KV on every hop (nothing recomputes it, so no journal holds
    it): each hop hands its reused prefix to its standby first, and a hop lost right after prefill is rebuilt. The
    prompt is long enough to have prefix keys, so the tracker sends the second run to the route that kept it."""
    nodes = await _three_hops(repair_settings, swarms)
    tracker = await swarms.actor(Tracker(repair_settings))
    gateway = await swarms.actor(Gateway(repair_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=3)
    prompt = "q" * 300
    expected, _ = await _stream(gateway.url + "/v1", prompt=prompt, max_tokens=24)
    nodes["spare"] = await swarms.node_process(repair_settings, "spare", stub_args("3:6", 0.005))
    await wait_model(tracker, MODEL, n_nodes=4)
    text, snaps = await _stream(gateway.url + "/v1", prompt=prompt, max_tokens=24, kill=nodes, hop=1,
                                after_tokens=2)
    assert text == expected
    assert snaps[-1]["prefill"].get("reused", 0) == 300, snaps[-1]["prefill"]
    assert snaps[-1]["repair"]["source"] == "snapshot", snaps[-1]["repair"]
