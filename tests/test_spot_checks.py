"""Issue #28: spot checks catch a node that computes wrong, a referee settles it, the tracker evicts it, and its
operator clears it. Stub swarms in-process (fast, deterministic) and real llama.cpp node processes serving the
bundled Gemma 3 270M with the three test-only bad nodes (``SWARMROUTE_TEST_MISBEHAVE``): noise, skipped layers and
another quantization advertised as the original. The sampling rate is raised to 1 so that every session is
checked."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from nats.aio.msg import Msg

from actors.backends.misbehaving import MisbehavingBackend, Misbehaviour, misbehaving
from actors.node import Node
from actors.node.config import NodeConfig
from actors.tracker import Tracker
from bus import codec
from bus.subjects import Subjects
from gateway.app import Gateway
from schemas.node import LayerRange
from schemas.settings import Settings
from schemas.spot_check import Dispute, DisputeReply, Eviction, SpotVerdict
from tests.support.swarm import STUB_MODEL, Swarms, make_settings, stub, wait_model
from tests.support.waiting import eventually

PROMPT = "The capital of France is"


def spot_settings(nats_url: str, home: Path, **kw: Any) -> Settings:
    return make_settings(nats_url, home, spot_check_rate=1.0, spot_check_positions=12, prefix_cache_mb=0,
                         snapshot_every=0, **kw)


async def complete(gateway: Gateway, *, max_tokens: int, model: str = STUB_MODEL,
                   prompt: str = PROMPT) -> tuple[str, list[str]]:
    """A greedy completion's text and the nodes of its route."""
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    chunks = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    text, route = "", []
    async for chunk in chunks:
        snap = (chunk.model_extra or {}).get("swarmroute")
        if snap and not route:
            route = [h["node_id"] for h in snap["route"]]
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
    return text, route


async def stub_swarm(settings: Settings, swarms: Swarms, bad: str = "") -> tuple[Tracker, list[Node], Gateway]:
    """Three nodes for layers 0:4 (``h1`` computing as ``bad`` says, when given), one for 4:8."""
    tracker = await swarms.actor(Tracker(settings))
    heads = [stub(0, 4) for _ in range(3)]
    backends = [misbehaving(heads[0], Misbehaviour.parse(bad)) if bad else heads[0], *heads[1:], stub(4, 8)]
    names = ["h1", "h2", "h3", "tail"]
    nodes = [await swarms.actor(Node(NodeConfig(node_id=name, model_id=STUB_MODEL), backend, settings))
             for name, backend in zip(names, backends, strict=True)]
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, STUB_MODEL, n_nodes=4)
    return tracker, nodes, gateway


async def swarmroute_cli(*argv: str) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "swarmroute", *argv,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


def checks(nodes: list[Node], role: str, outcome: str) -> float:
    total = 0.0
    for node in nodes:
        value = node.metrics.registry.get_sample_value("swarmroute_node_spot_checks_total",
                                                       {"role": role, "outcome": outcome})
        total += value or 0.0
    return total


HONEST_SESSIONS = 12


async def evicted_after(tracker: Tracker, node: str, send: Callable[[], Awaitable[object]], *, tries: int,
                        timeout: float) -> Eviction:
    """Requests sent one after another until ``node`` is evicted (at most ``tries``): its eviction, on a checker's
    disagreement."""
    assert tracker.evictions is not None
    for _ in range(tries):
        await send()
        if node in tracker.evictions.evicted:
            break
    await eventually(lambda: node in tracker.evictions.evicted, timeout=timeout, what=f"{node} evicted")
    eviction = tracker.evictions.evicted[node]
    assert eviction.checker is not None and not eviction.checker.agree
    return eviction


async def test_an_honest_swarm_sees_no_eviction(nats_server: Any, tmp_path: Path, swarms: Swarms) -> None:
    settings = spot_settings(nats_server.url, tmp_path / "home")
    tracker, nodes, gateway = await stub_swarm(settings, swarms)
    texts = {(await complete(gateway, max_tokens=16))[0] for _ in range(HONEST_SESSIONS)}
    assert len(texts) == 1
    await eventually(lambda: checks(nodes, "check", "agree") >= HONEST_SESSIONS, timeout=20,
                     what=f"{HONEST_SESSIONS} spot checks agreeing")
    assert checks(nodes, "check", "disagree") == 0
    assert tracker.evictions is not None and not tracker.evictions.evicted


async def test_a_noisy_node_is_evicted_and_cleared_by_its_operator(nats_server: Any, tmp_path: Path,
                                                                   swarms: Swarms) -> None:
    settings = spot_settings(nats_server.url, tmp_path / "home")
    tracker, nodes, gateway = await stub_swarm(settings, swarms, bad="noise:0.5")
    assert tracker.evictions is not None
    # Checkers are picked by build, then kernel family: every node advertises both.
    assert all(a.build_id and a.kernels_id == nodes[0].spot.kernels_id for a in tracker.registry.live())
    seen: list[Eviction] = []

    async def note(msg: Msg) -> None:
        seen.append(codec.decode(msg.data, Eviction))

    sub = await nodes[1].nc.subscribe(Subjects(settings.namespace).evictions(), cb=note)
    expected = ""
    for _ in range(20):
        text, route = await complete(gateway, max_tokens=16)
        if route[0] != "h1":
            expected = text
        if "h1" in tracker.evictions.evicted:
            break
    await eventually(lambda: "h1" in tracker.evictions.evicted, timeout=20, what="h1 evicted")
    eviction = tracker.evictions.evicted["h1"]
    assert eviction.checker is not None and eviction.referee is not None and not eviction.checker.agree
    if eviction.checker.node_id == "h1":  # h1 recomputed an honest receipt wrong; the referee sided with it
        assert eviction.referee.agree and eviction.referee.node_id != "h1"
    else:  # h1's own receipt: checker and referee both recomputed something else
        assert not eviction.referee.agree
        assert {eviction.checker.node_id, eviction.referee.node_id} == {"h2", "h3"}
    await eventually(lambda: any(e.node_id == "h1" for e in seen), timeout=5, what="the eviction on NATS")
    await sub.unsubscribe()
    sample = nodes[2].metrics.registry.get_sample_value("swarmroute_node_evicted_info", {
        "node": "h1", "layers": "[0, 4)", "rule": eviction.checker.rule,
        "median_rel_err": f"{eviction.checker.median_rel_err:.4g}",
        "median_top_k": f"{eviction.checker.median_top_k:.3f}"})
    assert sample == 1
    for _ in range(6):  # never routed to again, and every answer is the honest one
        text, route = await complete(gateway, max_tokens=16)
        assert "h1" not in route
        assert not expected or text == expected
    assert checks(nodes, "check", "disagree") >= 1
    # The operator lists and clears it with the CLI: routable again.
    listed = await swarmroute_cli("evictions", "list", "--json", "--nats", settings.nats_url)
    assert [e["node_id"] for e in json.loads(listed)] == ["h1"]
    # The operator fixes h1 and clears it once no check of its old work is under way: a dispute settled after the
    # clear would evict the still-noisy h1 again, for what it computed before.
    assert isinstance(nodes[0].backend, MisbehavingBackend)
    nodes[0].backend.repaired = True
    await eventually(lambda: not any(n.spot.busy for n in nodes), timeout=20, what="every spot check settled")
    assert "cleared node h1" in await swarmroute_cli("evictions", "clear", "h1", "--nats", settings.nats_url)
    await eventually(lambda: "h1" not in tracker.evictions.evicted, timeout=5, what="the eviction cleared")
    # Prompts of their own: the nodes that kept a prompt's prefix are routed to first for it (issue #26).
    heads: set[str] = set()
    for i in range(40):  # routed to again (heads are drawn among the least loaded: h1 may not be the first)
        heads.add((await complete(gateway, max_tokens=2, prompt=f"{i} {PROMPT}"))[1][0])
        if "h1" in heads:
            break
    assert "h1" in heads, heads


async def test_a_dispute_of_work_from_before_a_clear_evicts_nobody(nats_server: Any, tmp_path: Path,
                                                                   swarms: Swarms) -> None:
    """Disputes are settled after the fact: one of work h1 did before its operator cleared it must not evict it
    again; one of work after the clear does."""
    settings = spot_settings(nats_server.url, tmp_path / "home")
    tracker, nodes, _ = await stub_swarm(settings, swarms)
    assert tracker.evictions is not None
    subjects = Subjects(settings.namespace)
    wrong = SpotVerdict(node_id="h2", agree=False, exact=False, rule="band", positions=8, judged=8, max_rel_err=0.5,
                        min_top_k=0.2)

    async def dispute(clearance: int | None) -> DisputeReply:
        sent = Dispute(session_id="s", model_id=STUB_MODEL, layers=LayerRange(start=0, end=4), checked="h1",
                       checker=wrong, referee=wrong.model_copy(update={"node_id": "h3"}), clearance=clearance)
        msg = await nodes[1].nc.request(subjects.dispute_request, codec.encode(sent), timeout=10)
        return codec.decode(msg.data, DisputeReply)

    assert (await dispute(None)).evicted == "h1"
    assert "cleared node h1" in await swarmroute_cli("evictions", "clear", "h1", "--nats", settings.nats_url)
    await eventually(lambda: "h1" not in tracker.evictions.evicted, timeout=5, what="the eviction cleared")
    await eventually(lambda: nodes[0].spot.clearance == 1, timeout=5, what="h1 learning its clearance")
    old = await dispute(0)
    assert old.evicted == "" and "predates" in old.reason and "h1" not in tracker.evictions.evicted
    assert (await dispute(1)).evicted == "h1"  # work since the clear: judged
    assert tracker.evictions.evicted["h1"].clearance == 1
    assert "cleared node h1" in await swarmroute_cli("evictions", "clear", "h1", "--nats", settings.nats_url)
    await eventually(lambda: nodes[0].spot.clearance == 2, timeout=5, what="h1's second clear")
    assert (await dispute(1)).evicted == ""


async def tail_swarm(settings: Settings, swarms: Swarms, bad: str = "") -> tuple[Tracker, list[Node], Gateway]:
    """One head for layers 0:4, three tails for 4:8 (``t1`` computing as ``bad`` says, when given)."""
    tracker = await swarms.actor(Tracker(settings))
    tails = [stub(4, 8) for _ in range(3)]
    backends = [stub(0, 4), misbehaving(tails[0], Misbehaviour.parse(bad)) if bad else tails[0], *tails[1:]]
    nodes = [await swarms.actor(Node(NodeConfig(node_id=name, model_id=STUB_MODEL), backend, settings))
             for name, backend in zip(["head", "t1", "t2", "t3"], backends, strict=True)]
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, STUB_MODEL, n_nodes=4)
    return tracker, nodes, gateway


async def test_honest_tails_agree_and_a_noisy_tail_is_evicted(nats_server: Any, tmp_path: Path,
                                                              swarms: Swarms) -> None:
    """The tail's work is checked too: the largest logits of every row it sampled from, recomputed by another
    tail from the same inputs. Honest tails agree exactly; a tail computing on noisy inputs (its tokens wrong) is
    caught and evicted, and the swarm's text is the honest one again."""
    settings = spot_settings(nats_server.url, tmp_path / "home")
    tracker, nodes, gateway = await tail_swarm(settings, swarms)
    texts = {(await complete(gateway, max_tokens=16))[0] for _ in range(4)}
    assert len(texts) == 1
    tails = nodes[1:]
    await eventually(lambda: checks(tails, "check", "agree") >= 4, timeout=20, what="4 tail receipts agreeing")
    assert checks(nodes, "check", "disagree") == 0
    assert tracker.evictions is not None and not tracker.evictions.evicted
    # The same swarm with a noisy t1, in a namespace of its own.
    settings = spot_settings(nats_server.url, tmp_path / "home2", namespace="badtail")
    tracker, nodes, gateway = await tail_swarm(settings, swarms, bad="noise:0.5")
    eviction = await evicted_after(tracker, "t1", lambda: complete(gateway, max_tokens=16), tries=20, timeout=20)
    assert eviction.checker is not None and eviction.checker.rule == "exact"
    assert eviction.checker.median_top_k < 1 or eviction.checker.median_rel_err > 0
    assert set(tracker.evictions.evicted) == {"t1"}
    for _ in range(3):
        text, route = await complete(gateway, max_tokens=16)
        assert "t1" not in route and text in texts


async def test_a_tail_that_computes_right_and_draws_wrong_is_evicted(nats_server: Any, tmp_path: Path,
                                                                     swarms: Swarms) -> None:
    """Greedy sessions' draws are checked against the checker's logits: a tail whose logits are right but whose
    tokens are the runner-up is evicted on what it drew, not on its logits."""
    settings = spot_settings(nats_server.url, tmp_path / "home")
    tracker, nodes, gateway = await tail_swarm(settings, swarms, bad="draw")
    eviction = await evicted_after(tracker, "t1", lambda: complete(gateway, max_tokens=16), tries=20, timeout=20)
    assert eviction.checker is not None and eviction.checker.rule == "exact" and eviction.checker.first_bad is not None
    if eviction.checker.node_id != "t1":  # its own receipt: the logits agree, the draw does not
        assert eviction.checker.median_rel_err == 0 and eviction.checker.median_top_k == 1
    assert set(tracker.evictions.evicted) == {"t1"}


async def test_one_node_routes_are_checked_and_a_noisy_one_is_evicted(nats_server: Any, tmp_path: Path,
                                                                      swarms: Swarms) -> None:
    """A 1-node route's node is its own head and tail: its receipt runs from the prompt's tokens to the largest
    logits of every row it sampled from (prefill and the chained decode alike). Honest nodes agree exactly; a noisy
    one is evicted and the swarm answers with the honest text."""
    settings = spot_settings(nats_server.url, tmp_path / "home")
    tracker = await swarms.actor(Tracker(settings))
    backends = [stub(0, 8) for _ in range(3)]
    backends[0] = misbehaving(backends[0], Misbehaviour.parse("noise:0.5"))
    nodes = [await swarms.actor(Node(NodeConfig(node_id=name, model_id=STUB_MODEL), backend, settings))
             for name, backend in zip(["w1", "w2", "w3"], backends, strict=True)]
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, STUB_MODEL, n_nodes=3)
    honest: set[str] = set()
    assert tracker.evictions is not None
    for _ in range(30):
        text, route = await complete(gateway, max_tokens=16)
        assert len(route) == 1
        if route != ["w1"]:
            honest.add(text)
        if "w1" in tracker.evictions.evicted:
            break
    await eventually(lambda: "w1" in tracker.evictions.evicted, timeout=20, what="w1 evicted")
    eviction = tracker.evictions.evicted["w1"]
    assert eviction.checker is not None and eviction.referee is not None and not eviction.checker.agree
    assert eviction.checker.rule == "exact" and eviction.checker.positions > 0  # logits compared, not skipped
    assert checks(nodes, "checked", "submitted") >= 1
    assert set(tracker.evictions.evicted) == {"w1"}
    for _ in range(3):
        text, route = await complete(gateway, max_tokens=16)
        assert route != ["w1"]
        honest.add(text)
    assert len(honest) == 1  # one text, on every honest node


# ---- the real backend: llama.cpp node processes, the bundled Gemma 3 270M --------------------------------------

GEMMA = "gemma"
LONG_PROMPT = ("Here is a short story about a lighthouse keeper who finds a message in a bottle. " * 2).strip()
HONEST_LLAMA_SESSIONS = 4


def gemma_args(gemma_path: Path, layers: str) -> list[str]:
    return ["--backend", "llamacpp", "--model", str(gemma_path), "--model-id", GEMMA, "--layers", layers,
            "--threads", "1", "--ctx", "1024", "--max-sessions", "3"]


def llama_spot_settings(nats_url: str, home: Path, **kw: Any) -> Settings:
    return make_settings(nats_url, home, spot_check_rate=1.0, spot_check_positions=24, prefix_cache_mb=0,
                         snapshot_every=0, token_timeout_s=30.0, first_token_timeout_s=60.0, **kw)


async def llamacpp_swarm(settings: Settings, swarms: Swarms, gemma_path: Path,
                         nodes: list[tuple[str, str]]) -> tuple[Tracker, Gateway]:
    """llama.cpp node processes (name, layers), a tracker and a gateway, once every node is routable."""
    for name, layers in nodes:
        await swarms.node_process(settings, name, gemma_args(gemma_path, layers))
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, GEMMA, timeout=180, n_nodes=len(nodes))
    return tracker, gateway


async def stream(gateway: Gateway, *, max_tokens: int) -> tuple[str, list[dict[str, Any]]]:
    """A greedy completion's text and its telemetry snapshots."""
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    chunks = await client.completions.create(
        model=GEMMA, prompt=LONG_PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "stream_options": {"include_telemetry": True}})
    text, snaps = "", []
    async for chunk in chunks:
        snap = (chunk.model_extra or {}).get("swarmroute")
        if snap:
            snaps.append(snap)
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
    return text, snaps


@pytest.mark.slow
async def test_one_node_llamacpp_routes_are_checked_and_a_requantized_node_is_evicted(
        nats_server: Any, tmp_path: Path, swarms: Swarms, gemma_path: Path) -> None:
    """Whole-model llama.cpp nodes (each route is one node, its own head and tail): honest ones agree on each other's
    receipts (token ids in, the top logits of every sampled row out); one serving Q4_0 while advertising the
    original is evicted, and the text stays the honest one."""
    pytest.importorskip("llama_cpp")
    from tests.support.requantize import requantize

    settings = llama_spot_settings(nats_server.url, tmp_path / "home")
    other = requantize(gemma_path, tmp_path / "quant", "q4_0")
    tracker, gateway = await llamacpp_swarm(settings, swarms, gemma_path, [("w1", "0:18"), ("w2", "0:18")])
    assert tracker.evictions is not None
    honest = [await stream(gateway, max_tokens=32) for _ in range(HONEST_LLAMA_SESSIONS)]
    expected = honest[0][0]
    assert all(text == expected and len(snaps[-1]["route"]) == 1 for text, snaps in honest)
    await swarms.node_process(settings.model_copy(update={"test_misbehave": f"quant:{other}"}), "quantized",
                              gemma_args(gemma_path, "0:18"))
    await wait_model(tracker, GEMMA, timeout=180, n_nodes=3)
    for _ in range(12):
        text, snaps = await stream(gateway, max_tokens=32)
        assert snaps[-1]["phase"] == "complete"
        if snaps[-1]["route"][0]["node_id"] != "quantized":
            assert text == expected
        if "quantized" in tracker.evictions.evicted:
            break
    await eventually(lambda: "quantized" in tracker.evictions.evicted, timeout=60, what="the Q4_0 node evicted")
    eviction = tracker.evictions.evicted["quantized"]
    assert eviction.checker is not None and not eviction.checker.agree and eviction.checker.positions > 0
    assert set(tracker.evictions.evicted) == {"quantized"}  # the honest nodes agreed with each other
    text, snaps = await stream(gateway, max_tokens=32)
    assert text == expected and snaps[0]["route"][0]["node_id"] != "quantized"


@pytest.mark.slow
async def test_three_bad_llamacpp_nodes_are_caught_evicted_and_routed_around(
        nats_server: Any, tmp_path: Path, swarms: Swarms, gemma_path: Path) -> None:
    """An honest 3-hop swarm (two spare middles) runs HONEST_LLAMA_SESSIONS checked sessions without an eviction;
    then each bad middle joins in turn, is caught by the checks, evicted and never routed to again, its session
    completes (repaired around it when the eviction lands mid-stream) and the sessions after it give the honest
    text token for token."""
    pytest.importorskip("llama_cpp")
    from tests.support.requantize import requantize

    settings = llama_spot_settings(nats_server.url, tmp_path / "home", hop_timeout_s=30.0, repair_timeout_s=30.0)
    other = requantize(gemma_path, tmp_path / "quant", "q4_0")
    tracker, gateway = await llamacpp_swarm(settings, swarms, gemma_path,
                                            [("head", "0:6"), ("m2", "6:12"), ("m3", "6:12"), ("tail", "12:18")])
    assert tracker.evictions is not None
    honest = [await stream(gateway, max_tokens=48) for _ in range(HONEST_LLAMA_SESSIONS)]
    expected = honest[0][0]
    assert all(text == expected for text, _ in honest)
    assert not tracker.evictions.evicted, "an honest swarm evicted a node"

    for bad, misbehave in [("noisy", "noise:1.0"), ("skipper", "skip"), ("quantized", f"quant:{other}")]:
        await swarms.node_process(settings.model_copy(update={"test_misbehave": misbehave}), bad,
                                  gemma_args(gemma_path, "6:12"))
        await wait_model(tracker, GEMMA, timeout=180, n_nodes=5)
        sessions = 0
        while bad not in tracker.evictions.evicted and sessions < 12:
            text, snaps = await stream(gateway, max_tokens=48)
            sessions += 1
            assert snaps[-1]["phase"] == "complete", (bad, snaps[-1])
            if bad not in {h["node_id"] for h in snaps[-1]["route"]} and bad not in tracker.evictions.evicted:
                assert text == expected, (bad, "a route without the bad node gave another text")
        evicted = tracker.evictions.evicted
        await eventually(lambda: bad in evicted, timeout=60, what=f"{bad} evicted")  # noqa: B023
        eviction = tracker.evictions.evicted[bad]
        assert eviction.checker is not None and not eviction.checker.agree, eviction
        for _ in range(2):
            text, snaps = await stream(gateway, max_tokens=48)
            assert bad not in {h["node_id"] for h in snaps[0]["route"]}
            assert text == expected
    assert set(tracker.evictions.evicted) == {"noisy", "skipper", "quantized"}


@pytest.mark.slow
async def test_another_kernel_family_is_not_evicted_and_a_requantized_node_is(
        nats_server: Any, tmp_path: Path, swarms: Swarms, gemma_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Three nodes for layers 6:12 in one swarm: one on llama.cpp's default (repacked) kernels, one on its plain
    kernels (another build and kernel family: its boundary states differ from the first's by ~1.5e-2, as far as
    Q8_0's), and one computing with the model requantized to Q4_0 while it advertises the default build. Every
    session is checked: the pair of honest builds compare under the wide band and agree, the requantized node is
    caught and evicted, and the plain-kernel node never is."""
    pytest.importorskip("llama_cpp")
    from actors.backends import load_backend
    from tests.support.requantize import requantize

    caplog.set_level(logging.INFO, logger="actors.node.spot_check")
    settings = make_settings(nats_server.url, tmp_path / "home", spot_check_rate=1.0, spot_check_positions=16,
                             prefix_cache_mb=0, snapshot_every=0, token_timeout_s=60.0, first_token_timeout_s=120.0,
                             hop_timeout_s=60.0, heartbeat_s=1.0, registry_ttl_s=30.0)

    def shard(path: Path, layers: tuple[int, int], name: str, **options: object) -> Any:
        return load_backend("llamacpp", model_path=path, n_ctx=512, max_sessions=3, threads=1,
                            layer_start=layers[0], layer_end=layers[1], shard_dir=tmp_path / name, **options)

    quant = requantize(gemma_path, tmp_path / "quant", "q4_0")
    backends = {"head": shard(gemma_path, (0, 6), "head"), "repacked": shard(gemma_path, (6, 12), "repacked"),
                "plain": shard(gemma_path, (6, 12), "plain", extra_buffers=False),
                "quantized": misbehaving(shard(quant, (6, 12), "q4"), Misbehaviour.parse(f"quant:{quant}")),
                "tail": shard(gemma_path, (12, 18), "tail")}
    tracker = await swarms.actor(Tracker(settings))
    nodes = {name: await swarms.actor(Node(NodeConfig(node_id=name, model_id=GEMMA), backend, settings))
             for name, backend in backends.items()}
    assert nodes["plain"].spot.kernels_id != nodes["repacked"].spot.kernels_id
    assert nodes["quantized"].spot.kernels_id == nodes["repacked"].spot.kernels_id
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, GEMMA, timeout=180, n_nodes=len(nodes))
    await evicted_after(tracker, "quantized", lambda: stream(gateway, max_tokens=12), tries=12, timeout=60)
    assert set(tracker.evictions.evicted) == {"quantized"}
    # Sessions until both honest middles have checked each other: they never disagree.
    honest = [nodes["repacked"], nodes["plain"]]
    for _ in range(8):
        if checks(honest, "check", "agree") >= 2:
            break
        await stream(gateway, max_tokens=12)
    await eventually(lambda: checks(honest, "check", "agree") >= 2, timeout=60, what="honest checks agreeing")
    # (checked, checker, rule, outcome) of every recomputation the checkers logged
    pairs = {(r.args[1], r.args[2], r.args[7], r.args[6]) for r in caplog.records  # type: ignore[index]
             if r.name == "actors.node.spot_check" and r.msg.startswith("spot check (")}
    honest_pairs = {p for p in pairs if {p[0], p[1]} == {"plain", "repacked"}}
    assert any(p[2] == "wide" for p in honest_pairs), pairs
    assert all(p[3] == "agree" for p in honest_pairs), pairs
    assert "plain" not in tracker.evictions.evicted and "repacked" not in tracker.evictions.evicted
