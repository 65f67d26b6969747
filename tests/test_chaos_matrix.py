"""Issue #31 item 4, chaos under load: concurrent sessions on a real fleet while each actor is SIGKILLed in turn,
once during prefill and once during decode.

The fleet (``tests/support/chaos_fleet.py``) is real processes throughout: a 3-server NATS cluster with JetStream, a
tracker, six llama.cpp nodes serving the bundled Gemma 3 270M as a 3-node route (head 0:6, middle 6:12, tail 12:18)
with a spare for every range, and two gateways (the second speculates with ngram drafts). Every node runs
``llama_batch_invariant=all``, so a session's text does not depend on what else the route computes, and a repair's
replay under load computes what it replaces.

Sessions, all started together: greedy, seeded sampling (temperature 0.9, top-p 0.95), one speculative (greedy
through the speculating gateway) and one with a tool call (``tool_choice: required``: a grammar-constrained call).
That is the reduced size CI runs (4 sessions); ``SWARMROUTE_CHAOS_FULL=1`` runs the issue's 8 (a second greedy and
a second seeded completion, a greedy chat completion and a second seeded one). For the gateway the sessions are
Responses background sessions (greedy and seeded) and a chat-completions stream on the gateway that dies, beside
the speculative and the tool session on the other.

Killed in turn: the head, the middle node and the tail (each the node at that hop of the most sessions' routes, its
spare still running), the tracker, the NATS server the head's connection sits on, and a gateway. Every session
ends complete with the text and token count of its unfaulted solo run, or, a chat-completions stream whose gateway
died, with a broken connection and its session cancelled by its head; at the end of each case every node holds 0
sessions. The killed actor is started again before the next case. With ``-s`` each case prints how long after the
kill each affected session's next token came.

For debugging one case: ``SWARMROUTE_CHAOS_ONLY=seeded,greedy`` runs only those sessions,
``SWARMROUTE_CHAOS_NODE_LOG=info`` has the nodes log (printed after the kill), ``SWARMROUTE_CHAOS_SNAPSHOT_EVERY=0``
turns snapshots off (a repair then replays journals from position 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest

from tests.support import figures
from tests.support.chaos_fleet import ChaosFleet
from tests.support.nats_cluster import NatsCluster, start_cluster, wait_jetstream
from tests.support.swarm import make_settings
from tests.support.waiting import eventually

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow

FULL = os.environ.get("SWARMROUTE_CHAOS_FULL", "") == "1"
"""The issue's size: 8 concurrent sessions (4 otherwise)."""
MODEL = "gemma"
MAX_TOKENS = 20
PREFILL_CHUNK = 8
Api = Literal["completion", "chat", "tool", "response"]

STORY = ("The lighthouse keeper climbed the narrow stairs every night, checked the lamp, wrote the weather in his "
         "book and watched the ships pass far out at sea. One stormy evening a bottle washed up on the rocks below "
         "the tower, and inside it he found")
RECIPE = ("To bake a simple loaf of bread you need flour, water, salt and yeast. Mix them in a large bowl, knead the "
          "dough for ten minutes until it is smooth, let it rise for an hour in a warm place, shape it and")
REPEAT = ("Repeat after me exactly: the red fox runs past the old mill, the red fox runs past the old mill, the red "
          "fox runs past the old mill, the red fox runs past the old mill, the red fox")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
GREEDY: dict[str, Any] = {"temperature": 0}
SEEDED: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 7}


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    api: Api
    prompt: str
    sampling: dict[str, Any]
    gateway: str = "gateway"


SPEC = Kind("speculative", "completion", REPEAT, GREEDY, gateway="gateway-spec")
TOOL = Kind("tool", "tool", "What is the weather in Paris today? I am travelling there tomorrow morning for a "
            "meeting and want to know whether to take an umbrella and a warm coat.", GREEDY)
KINDS = [Kind("greedy", "completion", STORY, GREEDY), Kind("seeded", "completion", RECIPE, SEEDED), SPEC, TOOL]
if FULL:
    KINDS += [Kind("greedy-2", "completion", RECIPE, GREEDY),
              Kind("seeded-2", "completion", STORY, {**SEEDED, "seed": 11}),
              Kind("chat", "chat", STORY, GREEDY), Kind("seeded-3", "completion", REPEAT, {**SEEDED, "seed": 3})]
CHAT_ORPHAN = Kind("chat-orphan", "chat", RECIPE, GREEDY)
"""The gateway case's chat-completions stream on the gateway that dies: cancelled, never resumed."""
GATEWAY_KINDS = [Kind("response-greedy", "response", STORY, GREEDY),
                 Kind("response-seeded", "response", RECIPE, SEEDED), CHAT_ORPHAN,
                 dataclasses.replace(TOOL, gateway="gateway-spec"), SPEC]
if FULL:
    GATEWAY_KINDS += [Kind("response-greedy-2", "response", RECIPE, GREEDY),
                      Kind("response-seeded-2", "response", STORY, {**SEEDED, "seed": 11})]
ACTORS = ["head", "middle", "tail", "tracker", "nats", "gateway"]
HOP = {"head": 0, "middle": 1, "tail": 2}


# ---- one session --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    kind: Kind
    text: str = ""
    tokens: int | None = None
    """The completion tokens the session reported (usage)."""
    deltas: int = 0
    arrivals: list[float] = dataclasses.field(default_factory=list)
    route: list[str] = dataclasses.field(default_factory=list)
    phase: str = ""
    prefill_done: int = 0
    events: list[Any] = dataclasses.field(default_factory=list)
    """Responses: every stream event, across both gateways."""
    error: BaseException | None = None
    finished: bool = False
    resumed_on: str = ""

    def saw(self, text: str) -> None:
        if text:
            self.text += text
            self.deltas += 1
            self.arrivals.append(time.monotonic())

    def telemetry(self, extra: dict[str, Any] | None) -> None:
        snap = (extra or {}).get("swarmroute") or {}
        if snap.get("route"):
            self.route = [h["node_id"] for h in snap["route"]]
        if snap.get("phase"):
            self.phase = snap["phase"]
            self.prefill_done = (snap.get("prefill") or {}).get("done", 0)


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


STREAM_OPTIONS = {"stream_options": {"include_telemetry": True, "include_usage": True}}


async def _completion(api: openai.AsyncOpenAI, run: Run) -> None:
    k = run.kind
    chunks = await api.completions.create(model=MODEL, prompt=k.prompt, max_tokens=MAX_TOKENS, stream=True,
                                          **k.sampling, extra_body={"ignore_eos": True, **STREAM_OPTIONS})
    async for chunk in chunks:
        run.telemetry(chunk.model_extra)
        if chunk.choices:
            run.saw(chunk.choices[0].text)
            run.finished = run.finished or chunk.choices[0].finish_reason is not None
        if chunk.usage is not None:
            run.tokens = chunk.usage.completion_tokens


async def _chat(api: openai.AsyncOpenAI, run: Run) -> None:
    k = run.kind
    tools: dict[str, Any] = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False} \
        if k.api == "tool" else {}
    extra = STREAM_OPTIONS if k.api == "tool" else {"ignore_eos": True, **STREAM_OPTIONS}
    chunks = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": k.prompt}],
                                               max_tokens=MAX_TOKENS * 2 if k.api == "tool" else MAX_TOKENS,
                                               stream=True, **k.sampling, **tools, extra_body=extra)
    async for chunk in chunks:
        run.telemetry(chunk.model_extra)
        if chunk.choices:
            delta = chunk.choices[0].delta
            calls = "".join((c.function.name or "") + (c.function.arguments or "")
                            for c in delta.tool_calls or [] if c.function is not None)
            run.saw((delta.content or "") + calls)
            run.finished = run.finished or chunk.choices[0].finish_reason is not None
        if chunk.usage is not None:
            run.tokens = chunk.usage.completion_tokens


async def _response(fleet: ChaosFleet, run: Run) -> None:
    """A background response, read on its gateway; if that dies, read on from the other one after the last
    sequence number seen (``retrieve(..., stream=True, starting_after=N)``)."""
    k = run.kind
    extra = {"seed": k.sampling["seed"]} if "seed" in k.sampling else {}
    sampling = {key: v for key, v in k.sampling.items() if key != "seed"}
    try:
        async with client(fleet.url(k.gateway)) as api:
            async for event in await api.responses.create(model=MODEL, input=k.prompt, max_output_tokens=MAX_TOKENS,
                                                          background=True, stream=True, **sampling, extra_body=extra):
                _response_event(run, event)
        return
    except openai.APIConnectionError:
        if not run.events:
            raise
    run.resumed_on = "gateway-spec"
    async with client(fleet.url(run.resumed_on)) as api:
        async for event in await api.responses.retrieve(run.events[0].response.id, stream=True,
                                                        starting_after=run.events[-1].sequence_number):
            _response_event(run, event)


def _response_event(run: Run, event: Any) -> None:
    run.events.append(event)
    if event.type == "response.output_text.delta":
        run.saw(event.delta)
    if event.type in ("response.completed", "response.incomplete"):
        run.finished = True
        run.tokens = event.response.usage.output_tokens if event.response.usage else None


async def drive(fleet: ChaosFleet, run: Run) -> Run:
    try:
        if run.kind.api == "response":
            await _response(fleet, run)
        else:
            async with client(fleet.url(run.kind.gateway)) as api:
                await (_completion if run.kind.api == "completion" else _chat)(api, run)
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test inspects
        run.error = exc
    return run


# ---- the fleet and the unfaulted runs ---------------------------------------------------------------------------

@dataclasses.dataclass
class Reference:
    text: str
    tokens: int | None


class Matrix:
    def __init__(self, fleet: ChaosFleet) -> None:
        self.fleet = fleet
        self.references: dict[str, Reference] = {}

    async def reference(self, kinds: list[Kind]) -> dict[str, Reference]:
        """Each kind's unfaulted run, alone on the fleet (once per kind)."""
        for kind in kinds:
            if kind.name in self.references or kind is CHAT_ORPHAN:
                continue
            run = await drive(self.fleet, Run(kind))
            assert run.error is None and run.finished and run.text, (kind.name, run.error)
            self.references[kind.name] = Reference(run.text, run.tokens)
        return self.references


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    c = start_cluster(tmp_path_factory.mktemp("chaos-nats"))
    try:
        asyncio.run(wait_jetstream(c.urls))
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def matrix(cluster: NatsCluster, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    # Generous timeouts and registry TTL (llama.cpp on a shared 2-core machine, 6 nodes); snapshots every 16
    # positions; no prefix cache, so a freed session leaves no KV; client probes 0.5 s apart, so a chat stream's
    # orphan is cancelled within seconds; every JetStream stream on all three servers.
    settings = make_settings(cluster.urls[0], tmp_path_factory.mktemp("chaos") / "home", namespace="chaosmx",
                             heartbeat_s=1.0, registry_ttl_s=15.0, token_timeout_s=60.0, first_token_timeout_s=120.0,
                             hop_timeout_s=30.0, repair_timeout_s=60.0, prefix_cache_mb=0.0,
                             snapshot_every=int(os.environ.get("SWARMROUTE_CHAOS_SNAPSHOT_EVERY", "16")),
                             prefill_chunk=PREFILL_CHUNK, llama_batch_invariant="all", registry_replicas=3,
                             responses_replicas=3)
    fleet = ChaosFleet(settings, cluster, gemma_path, max_sessions=2 * len(KINDS) + 2)
    try:
        fleet.start_all()
        yield Matrix(fleet)
    finally:
        assert fleet.close() == [], "processes outlived the test"


async def _routable(fleet: ChaosFleet) -> None:
    async def answers() -> bool:
        async with client(fleet.url("gateway")) as api:
            await api.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        return True

    routed: bool = await eventually(answers, timeout=180, interval=0.5, ignoring=(openai.APIError,),
                                    what="the llama.cpp route becoming routable")
    assert routed


# ---- the kill -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Kill:
    victim: str
    at: float
    affected: list[Run]
    phases: dict[str, str]
    """Each affected session's phase when the kill came."""


def _victim_node(runs: list[Run], hop: int) -> str:
    """The node at ``hop`` of the speculative session's route (its repair is the hardest), else of the most
    routes."""
    counts = Counter(r.route[hop] for r in runs)
    spec = next((r.route[hop] for r in runs if r.kind is SPEC), None)
    return max(counts, key=lambda n: (n == spec, counts[n]))


def _due(runs: list[Run], phase: str) -> bool:
    if phase == "prefill":
        return any(r.phase == "prefill" and r.prefill_done >= PREFILL_CHUNK for r in runs)
    return any(r.deltas >= 4 for r in runs)


async def kill_when_due(fleet: ChaosFleet, runs: list[Run], actor: str, phase: str) -> Kill:
    watched = [r for r in runs if r.kind.api != "response"]
    await eventually(lambda: all(r.route or r.error for r in watched), timeout=120, interval=0.005,
                     what=lambda: f"every session showing its route ({[(r.kind.name, r.route) for r in runs]})")
    if actor in HOP:
        victim = _victim_node(watched, HOP[actor])
        affected = [r for r in watched if victim in r.route]
    elif actor == "nats":
        head = _victim_node(watched, 0)
        victim = f"nats-{fleet.nats_member_of(head)}"
        affected = [r for r in watched if head in r.route]
    elif actor == "gateway":
        victim = "gateway"
        affected = [r for r in runs if r.kind.gateway == "gateway"]
    else:
        victim, affected = "tracker", list(runs)
    if actor == "gateway":
        responses = [r for r in affected if r.kind.api == "response"]

        def due() -> bool:
            if phase == "prefill":  # opened (created, in progress), nothing decoded yet
                return all(len(r.events) >= 2 for r in responses) and CHAT_ORPHAN in [r.kind for r in affected]
            return any(r.deltas >= 4 for r in responses)

        await eventually(due, timeout=120, interval=0.005, what=f"the {phase} to kill the gateway in")
    else:
        await eventually(lambda: _due(affected, phase), timeout=120, interval=0.005,
                         what=lambda: f"the {phase} to kill {victim} in "
                                      f"({[(r.kind.name, r.phase, r.prefill_done, r.deltas) for r in affected]})")
    phases = {r.kind.name: (f"decode ({r.deltas} tokens in)" if r.deltas else r.phase or "opening")
              for r in affected}
    at = time.monotonic()
    if victim.startswith("nats-"):
        fleet.cluster.members[int(victim[5:])].server.kill()
    else:
        fleet.procs[victim].kill()
    return Kill(victim, at, affected, phases)


async def _restore(fleet: ChaosFleet) -> None:
    """The actor the last case killed, started again."""
    victim, fleet.pending = fleet.pending, None
    if victim is None:
        return
    if victim.startswith("nats-"):
        member = fleet.cluster.members[int(victim[5:])]
        await asyncio.to_thread(member.server.start)
        await wait_jetstream(fleet.cluster.urls)
    else:
        await asyncio.to_thread(fleet.restart, victim)
    await asyncio.sleep(fleet.settings.heartbeat_s * 2)  # its advertisement reaches the tracker


# ---- the matrix ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("actor", ACTORS)
async def test_every_session_survives_a_kill(matrix: Matrix, actor: str, phase: str) -> None:
    fleet = matrix.fleet
    kinds = GATEWAY_KINDS if actor == "gateway" else KINDS
    await _restore(fleet)  # after a case that failed
    await _routable(fleet)
    references = await matrix.reference(kinds)
    await fleet.freed()
    only = os.environ.get("SWARMROUTE_CHAOS_ONLY")
    runs = [Run(k) for k in kinds if not only or k.name in only.split(",")]
    tasks = [asyncio.create_task(drive(fleet, r)) for r in runs]
    kill: Kill | None = None
    try:
        kill = await kill_when_due(fleet, runs, actor, phase)
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
    finally:
        for t in tasks:
            t.cancel()
        if kill is not None:
            fleet.pending = kill.victim  # started again before the next case, whatever this one's outcome
    ended_s = time.monotonic() - kill.at
    if os.environ.get("SWARMROUTE_CHAOS_NODE_LOG"):  # debugging: what the nodes said
        for name, proc in fleet.procs.items():
            print(f"===== {name}\n" + "\n".join(line for line in proc.lines if "session" in line or "rror" in line))
    print(f"\n[chaos] {actor} ({kill.victim}) killed in {phase}: sessions hit {kill.phases}; routes "
          f"{ {r.kind.name: r.route for r in runs} }")
    for run in runs:
        if run.kind is CHAT_ORPHAN:  # its gateway is gone: nobody is left to tell its client more
            assert isinstance(run.error, openai.APIConnectionError) and not run.finished, (run.error, run.finished)
            continue
        ref = references[run.kind.name]
        assert run.error is None and run.finished, (actor, phase, run.kind.name, run.error)
        assert (run.text, run.tokens) == (ref.text, ref.tokens), (actor, phase, run.kind.name, run.route)
    for run in runs:
        if run.kind.api == "response":
            seqs = [e.sequence_number for e in run.events]
            assert seqs == list(range(len(seqs))), (run.kind.name, seqs)  # every event once, across gateways
    freed_at = time.monotonic()
    await fleet.freed()
    gaps = {r.kind.name: round(next((a for a in r.arrivals if a > kill.at), kill.at) - kill.at, 2)
            for r in kill.affected if r.kind is not CHAT_ORPHAN}
    print(f"[chaos] {actor} ({kill.victim}) killed in {phase}: kill to next token "
          f"{gaps} s; all ended {ended_s:.2f} s after the kill; nodes at 0 sessions "
          f"{time.monotonic() - freed_at:.2f} s after that")
    figures.add("chaos_matrix", f"{actor}_{phase}")
    figures.record(f"chaos_matrix_{actor}_{phase}", victim=kill.victim, hit=kill.phases, kill_to_next_token_s=gaps,
                   all_ended_after_kill_s=round(ended_s, 2))
    await _restore(fleet)
