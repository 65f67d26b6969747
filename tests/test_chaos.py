"""Chaos with real processes: SIGKILL a node (mid-prefill, mid-decode), the tracker, a gateway, the NATS server.

Every actor is its own ``swarmroute`` process, as on a fleet. For each fault: the affected client gets the
structured failure (or, when its own gateway dies, a broken connection — nobody is left to tell it more), sessions
on other nodes or gateways finish untouched, every surviving node frees the KV (``/health`` sessions back to 0),
new sessions route again once the registry recovers, and no process outlives the test. Bounded in time throughout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bus.server import EmbeddedNats, NatsServerConfig, wait_port_free
from schemas.settings import Settings
from tests.support import figures
from tests.support.actors import ActorProcess, orphans
from tests.support.swarm import make_settings
from tests.support.waiting import eventually

MODEL = "stub-model"
STEP_S = 0.01
"""Stub compute per step: with two hops ~20-30 ms per token, like a small model on a CPU."""


def stub_node(layers: str, *, max_sessions: int = 4, delay: float = STEP_S) -> list[str]:
    return ["--backend", "stub", "--model", MODEL, "--n-layers", "8", "--layers", layers, "--stub-delay", str(delay),
            "--max-sessions", str(max_sessions)]


class Fleet:
    """Actor processes of one test; ``close()`` stops all and reports any that outlived it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.procs: list[ActorProcess] = []

    def start(self, role: str, args: list[str], **kw: Any) -> ActorProcess:
        proc = ActorProcess(role, self.settings, args, **kw)
        self.procs.append(proc)
        return proc

    def node(self, node_id: str, layers: str, **kw: Any) -> ActorProcess:
        return self.start("node", ["--node-id", node_id, *stub_node(layers, **kw)])

    def gateway(self) -> ActorProcess:
        return self.start("gateway", ["--port", "0"])

    def tracker(self) -> ActorProcess:
        return self.start("tracker", [])

    def nodes(self) -> list[ActorProcess]:
        return [p for p in self.procs if p.role == "node" and p.proc.poll() is None]

    def close(self) -> list[int]:
        for p in self.procs:
            p.stop()
        return orphans([p.pid for p in self.procs])


@pytest.fixture
def chaos_settings(nats_server: EmbeddedNats, tmp_path: Path) -> Settings:
    # Fail-stop, as alpha: these measure how a failure stays contained; tests/test_repair.py covers repair.
    return make_settings(nats_server.url, tmp_path / "home", token_timeout_s=3.0, first_token_timeout_s=5.0,
                         hop_timeout_s=2.0, prefill_chunk=4, repair=False)


@pytest.fixture
def fleet(chaos_settings: Settings) -> Iterator[Fleet]:
    f = Fleet(chaos_settings)
    yield f
    assert f.close() == [], "processes outlived the test"


async def wait_routable(gateway_url: str, timeout: float = 20.0) -> float:
    """Until a real request succeeds through ``gateway_url``; returns how long that took."""
    started = time.monotonic()
    client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=10)
    await eventually(lambda: client.completions.create(model=MODEL, prompt="ping", max_tokens=1), timeout=timeout,
                     interval=0.2, ignoring=(openai.APIStatusError, openai.APIConnectionError),
                     what=f"a route through {gateway_url}")
    return time.monotonic() - started


async def sessions_on(endpoint: str) -> int | None:
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            return int((await http.get(f"{endpoint}/health")).json()["sessions"])
    except httpx.HTTPError:
        return None


async def all_freed(nodes: list[ActorProcess], timeout: float = 10.0) -> float:
    """Until every live node reports 0 sessions; returns the time it took."""
    started = time.monotonic()
    counts: list[int | None] = []

    async def freed() -> bool:
        counts[:] = [await sessions_on(n.url) for n in nodes]
        return all(c == 0 for c in counts)

    await eventually(freed, timeout=timeout, interval=0.1,
                     what=lambda: f"the nodes freeing their sessions (they hold: {counts})")
    return time.monotonic() - started


@dataclasses.dataclass
class Outcome:
    tokens: int = 0
    text: str = ""
    route: list[str] = dataclasses.field(default_factory=list)
    phase: str = ""
    prefill_done: int = 0
    error: BaseException | None = None
    finished: bool = False

    @property
    def failure(self) -> dict[str, Any]:
        body = getattr(self.error, "body", None)
        return (body.get("failure") or {}) if isinstance(body, dict) else {}


async def stream(gateway_url: str, out: Outcome, *, prompt: str = "hello", max_tokens: int = 60) -> Outcome:
    """A streaming completion with telemetry; records its route, progress and how it ended."""
    client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        async with client:
            await _consume(client, out, prompt, max_tokens)
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test inspects
        out.error = exc
    return out


async def _consume(client: openai.AsyncOpenAI, out: Outcome, prompt: str, max_tokens: int) -> None:
    chunks = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0,
        extra_body={"ignore_eos": True, "stream_options": {"include_telemetry": True}})
    async for chunk in chunks:
        snap = (chunk.model_extra or {}).get("swarmroute") or {}
        if snap.get("route"):
            out.route = [h["node_id"] for h in snap["route"]]
            out.phase = snap.get("phase", out.phase)
            out.prefill_done = (snap.get("prefill") or {}).get("done", 0)
        if chunk.choices and chunk.choices[0].text:
            out.tokens += 1
            out.text += chunk.choices[0].text
        if chunk.choices and chunk.choices[0].finish_reason:
            out.finished = True


def by_id(fleet: Fleet, node_id: str) -> ActorProcess:
    return next(p for p in fleet.procs if p.role == "node" and f"--node-id {node_id} " in " ".join(p.proc.args) + " ")


# ---- nodes ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_node_killed_fails_only_its_session(fleet: Fleet, phase: str) -> None:
    fleet.tracker()
    # One session per node: two concurrent sessions must take disjoint routes.
    for node_id, layers in (("a1", "0:4"), ("a2", "4:8"), ("b1", "0:4"), ("b2", "4:8")):
        fleet.node(node_id, layers, max_sessions=1, delay=0.03 if phase == "prefill" else STEP_S)
    gateway = fleet.gateway()
    assert gateway.url.startswith("http://127.0.0.1:")  # where it said it serves, on loopback
    await wait_routable(gateway.url)
    await all_freed(fleet.nodes())
    await asyncio.sleep(fleet.settings.heartbeat_s * 2)  # the probe's route no longer counts as pending
    victim, bystander = Outcome(), Outcome()
    prompt = "p" * 160 if phase == "prefill" else "hello"  # 161 tokens in chunks of 4: seconds of prefill
    hit = asyncio.create_task(stream(gateway.url, victim, prompt=prompt))
    await eventually(lambda: bool(victim.route), timeout=20.0, interval=0.01,
                     what="the victim's stream showing its route")
    other = asyncio.create_task(stream(gateway.url, bystander, max_tokens=80))
    await eventually(lambda: bool(bystander.route), timeout=20.0, interval=0.01,
                     what="the bystander's stream showing its route")
    assert not set(victim.route) & set(bystander.route)
    if phase == "prefill":
        await eventually(lambda: victim.prefill_done >= 40, timeout=20.0, interval=0.01,
                         what="the victim's prefill reaching 40 positions")
        assert victim.tokens == 0
    else:
        await eventually(lambda: victim.tokens >= 5, timeout=20.0, interval=0.01,
                         what="5 tokens on the victim's stream")
    dead = victim.route[-1]
    killed_at = time.monotonic()
    by_id(fleet, dead).kill()
    await asyncio.wait_for(hit, 30)
    detected_s = time.monotonic() - killed_at
    assert isinstance(victim.error, openai.APIError), victim.error
    assert victim.failure.get("node_id") == dead and victim.failure.get("phase") == phase
    assert dead in victim.error.message and phase in victim.error.message
    await asyncio.wait_for(other, 30)
    assert bystander.error is None and bystander.finished and bystander.tokens == 80
    freed_s = await all_freed(fleet.nodes())
    figures.add("chaos", f"node_kill_{phase}_injected")
    figures.record(f"chaos_node_kill_{phase}", detected_s=round(detected_s, 2), survivors_freed_s=round(freed_s, 2),
                   unaffected_tokens=bystander.tokens, structured_failure=True)


# ---- tracker ----------------------------------------------------------------------------------------------------

async def test_tracker_killed_does_not_disturb_sessions_and_restart_routes_again(fleet: Fleet) -> None:
    tracker = fleet.tracker()
    fleet.node("h", "0:4")
    fleet.node("t", "4:8")
    gateway = fleet.gateway()
    assert gateway.url.startswith("http://127.0.0.1:")  # where it said it serves, on loopback
    await wait_routable(gateway.url)
    running = Outcome()
    task = asyncio.create_task(stream(gateway.url, running, max_tokens=100))
    await eventually(lambda: running.tokens >= 5, timeout=20.0, interval=0.01, what="5 tokens on the running stream")
    tracker.kill()
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert refused.value.status_code == 503 and "tracker" in refused.value.message
    await asyncio.wait_for(task, 30)
    assert running.error is None and running.finished and running.tokens == 100  # the tracker is off the data path
    restarted_at = time.monotonic()
    fleet.tracker()  # returns once the new process reports ready
    await wait_routable(gateway.url)
    routable_s = time.monotonic() - restarted_at
    await all_freed(fleet.nodes())
    figures.add("chaos", "tracker_kill_injected")
    figures.record("chaos_tracker_kill", in_flight_tokens=running.tokens, outage_status=503,
                   routable_after_restart_s=round(routable_s, 2))


# ---- gateway ----------------------------------------------------------------------------------------------------

async def test_gateway_killed_breaks_only_its_clients_and_nodes_free_the_kv(fleet: Fleet) -> None:
    fleet.tracker()
    fleet.node("h", "0:4")
    fleet.node("t", "4:8")
    doomed, spare = fleet.gateway(), fleet.gateway()
    assert doomed.url.startswith("http://127.0.0.1:") and spare.url.startswith("http://127.0.0.1:")
    await wait_routable(doomed.url)
    victim, bystander = Outcome(), Outcome()
    # At ~25 ms per token the orphan would run for ~100 s to its max_tokens; the head cancels it long before.
    hit = asyncio.create_task(stream(doomed.url, victim, max_tokens=4000))
    other = asyncio.create_task(stream(spare.url, bystander, max_tokens=80))
    await eventually(lambda: victim.tokens >= 5 and bystander.tokens >= 5, timeout=20.0, interval=0.01,
                     what="5 tokens on both streams")
    doomed.kill()
    killed_at = time.monotonic()
    await asyncio.wait_for(hit, 30)
    assert victim.error is not None and not victim.finished  # its server is gone: a broken connection
    await asyncio.wait_for(other, 30)
    assert bystander.error is None and bystander.finished and bystander.tokens == 80
    # Its head finds nobody listening (three probes 0.5 s apart), cancels it and frees it on every hop.
    await all_freed(fleet.nodes(), timeout=15)
    freed_s = time.monotonic() - killed_at
    head = fleet.nodes()[0]
    async with httpx.AsyncClient(timeout=5) as http:
        metrics = (await http.get(f"{head.url}/metrics")).text
    assert 'swarmroute_node_sessions_ended_total{outcome="cancelled"} 1.0' in metrics, metrics
    figures.add("chaos", "gateway_kill_injected")
    figures.record("chaos_gateway_kill", unaffected_tokens=bystander.tokens,
                   orphaned_session_freed_after_kill_s=round(freed_s, 2))


# ---- NATS -------------------------------------------------------------------------------------------------------

class OwnNats:
    """A NATS server a test may kill and restart on the same port."""

    def __init__(self, store_dir: Path) -> None:
        self.store_dir = store_dir
        self.server = EmbeddedNats(NatsServerConfig(store_dir=store_dir)).start()

    @property
    def url(self) -> str:
        return self.server.url

    def kill(self) -> None:
        self.server.kill()

    async def restart(self) -> EmbeddedNats:
        """A new server on the killed one's port and store; the one stopped at the end."""
        port = self.server.port
        await asyncio.to_thread(wait_port_free, "127.0.0.1", port)
        self.server = await asyncio.to_thread(
            EmbeddedNats(NatsServerConfig(store_dir=self.store_dir, port=port)).start)
        return self.server


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[OwnNats]:
    own = OwnNats(tmp_path / "nats-own")
    yield own
    own.server.stop()


@pytest.fixture
def nats_fleet(own_nats: OwnNats, tmp_path: Path) -> Iterator[Fleet]:
    # Client probes at the default spacing: while the server restarts, a head may reconnect before its gateway.
    settings = make_settings(own_nats.url, tmp_path / "home", token_timeout_s=3.0, first_token_timeout_s=5.0,
                             hop_timeout_s=2.0, client_probe_s=5.0)
    f = Fleet(settings)
    yield f
    assert f.close() == [], "processes outlived the test"


async def registry_has(url: str, settings: Settings, node_ids: set[str], timeout: float = 15.0) -> float:
    """Until the registry bucket (JetStream KV, in memory: gone with a restarted server) lists ``node_ids``."""
    import nats

    from bus.subjects import Subjects

    started = time.monotonic()
    async with await nats.connect(url) as nc:
        async def listed() -> bool:
            kv = await nc.jetstream().key_value(Subjects(settings.namespace).registry_bucket)
            return node_ids <= set(await kv.keys())

        await eventually(listed, timeout=timeout, interval=0.2, ignoring=(Exception,),
                         what=f"the registry bucket listing {sorted(node_ids)}")
    return time.monotonic() - started


async def test_nats_killed_briefly_never_corrupts_a_stream(nats_fleet: Fleet, own_nats: OwnNats) -> None:
    """Core NATS is at-most-once: token events in the dead server's socket buffers are gone. A stream must then
    either complete exactly as without the fault (everything after the outage was buffered by the head's client and
    replayed in order) or fail with the structured 'lost on the bus' reason — never a silently different text. The
    reason comes from a gap in the tokens, or, when the gateway reconnected too late to see any later event (the head
    may finish meanwhile), from the token timeout of a gateway that knows its own connection dropped."""
    nats_fleet.tracker()
    nats_fleet.node("h", "0:4")
    nats_fleet.node("t", "4:8")
    gateway = nats_fleet.gateway()
    assert gateway.url.startswith("http://127.0.0.1:")  # where it said it serves, on loopback
    await wait_routable(gateway.url)
    reference = await stream(gateway.url, Outcome(), max_tokens=100)
    assert reference.finished and reference.tokens == 100
    running = Outcome()
    task = asyncio.create_task(stream(gateway.url, running, max_tokens=100))
    await eventually(lambda: running.tokens >= 5, timeout=20.0, interval=0.01, what="5 tokens on the running stream")
    own_nats.kill()
    server = await own_nats.restart()
    await asyncio.wait_for(task, 30)
    if running.error is None:
        assert running.finished and running.text == reference.text
    else:
        assert isinstance(running.error, openai.APIError) and running.failure.get("kind") == "protocol"
        assert "lost on the bus" in running.error.message
    recovery_s = await wait_routable(gateway.url)
    await all_freed(nats_fleet.nodes())
    try:
        kv_s = await registry_has(server.url, nats_fleet.settings, {"h", "t"})  # the nodes re-created the bucket
    except AssertionError:
        for p in nats_fleet.procs:
            print("=====", p.role, "\n".join(p.lines[-40:]))
        raise
    figures.add("chaos", "nats_kill_brief_injected")
    figures.add("chaos", "nats_kill_brief_completed" if running.error is None else "nats_kill_brief_gap_detected")
    figures.record("chaos_nats_kill_brief", last_outcome="completed" if running.error is None else "gap detected",
                   routable_after_restart_s=round(recovery_s, 2), registry_kv_back_s=round(kv_s, 2))


async def test_nats_down_fails_sessions_cleanly_and_recovers(nats_fleet: Fleet, own_nats: OwnNats) -> None:
    nats_fleet.tracker()
    nats_fleet.node("h", "0:4")
    nats_fleet.node("t", "4:8")
    gateway = nats_fleet.gateway()
    assert gateway.url.startswith("http://127.0.0.1:")  # where it said it serves, on loopback
    await wait_routable(gateway.url)
    running = Outcome()
    task = asyncio.create_task(stream(gateway.url, running, max_tokens=400))
    await eventually(lambda: running.tokens >= 5, timeout=20.0, interval=0.01, what="5 tokens on the running stream")
    own_nats.kill()
    killed_at = time.monotonic()
    await asyncio.wait_for(task, 30)
    detected_s = time.monotonic() - killed_at
    assert isinstance(running.error, openai.APIError) and running.failure.get("kind") == "timeout"
    assert "silent" in running.error.message or "stopped answering" in running.error.message
    freed_s = await all_freed(nats_fleet.nodes())  # the gateway closed the session on every hop over HTTP
    await own_nats.restart()
    recovery_s = await wait_routable(gateway.url, timeout=30)
    figures.add("chaos", "nats_kill_long_injected")
    figures.record("chaos_nats_kill_long", detected_s=round(detected_s, 2), freed_s=round(freed_s, 2),
                   routable_after_restart_s=round(recovery_s, 2))


# ---- real model -------------------------------------------------------------------------------------------------

@pytest.mark.slow
async def test_llamacpp_tail_killed_mid_decode(fleet: Fleet, gemma_path: Path) -> None:
    pytest.importorskip("actors.backends.llamacpp.backend")
    fleet.tracker()
    common = ["--backend", "llamacpp", "--model", str(gemma_path), "--threads", "1", "--ctx", "512",
              "--max-sessions", "2"]
    head = fleet.start("node", ["--node-id", "lh", "--layers", "0:9", *common], ready_timeout=180)
    fleet.start("node", ["--node-id", "lt", "--layers", "9:18", *common], ready_timeout=180)
    gateway = fleet.gateway()
    assert gateway.url.startswith("http://127.0.0.1:")  # where it said it serves, on loopback
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def complete_model() -> str | None:  # the model id is content-derived: taken once the route is complete
        complete = [m.id for m in (await client.models.list()).data if (m.model_extra or {}).get("complete")]
        return complete[0] if complete else None

    model = await eventually(complete_model, timeout=60, interval=0.5, what="the llama.cpp route becoming routable")
    await client.completions.create(model=model, prompt="hi", max_tokens=1)
    await asyncio.sleep(fleet.settings.heartbeat_s * 2)  # the warm-up's route no longer counts as pending
    tokens = 0
    with pytest.raises(openai.APIError) as failure:
        chunks = await client.completions.create(model=model, prompt="The capital of France is", max_tokens=200,
                                                 stream=True, temperature=0, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                tokens += 1
                if tokens == 5:
                    by_id(fleet, "lt").kill()
    body = failure.value.body if isinstance(failure.value.body, dict) else {}
    assert (body.get("failure") or {}).get("node_id") == "lt" and "decode" in failure.value.message
    await all_freed([head])
    figures.add("chaos", "llamacpp_node_kill_injected")
