"""Upgrading a node without breaking anyone: SIGTERM drains it (out of the registry at once, its open stream
finishes, then the process exits), and new sessions route to a spare node meanwhile."""

from __future__ import annotations

import time

import openai

from actors.tracker import Tracker
from gateway.app import Gateway
from schemas.session import Prompt
from schemas.settings import Settings
from tests.support.fleet import stub_reference
from tests.support.swarm import Swarms, make_settings, wait_model
from tests.support.waiting import eventually

MODEL = "stub-model"


def stub_args(layers: str) -> list[str]:
    return ["--backend", "stub", "--model", MODEL, "--layers", layers, "--n-layers", "8", "--stub-delay", "0.02"]


async def test_sigterm_drains_a_node_while_its_stream_finishes(nats_server: object, tmp_path: object,
                                                                swarms: Swarms) -> None:
    settings: Settings = make_settings(nats_server.url, tmp_path / "home", drain_timeout_s=30.0)  # type: ignore[attr-defined,operator]
    await swarms.node_process(settings, "head", stub_args("0:4"))
    old = await swarms.node_process(settings, "old", stub_args("4:8"))
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=2)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    prompt, n = "drain me gently", 100
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    pieces: list[str] = []
    drained_at = 0.0
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if len(pieces) == 10 and not drained_at:
            old.proc.terminate()  # SIGTERM, as `kubectl delete pod` or `docker stop` sends
            drained_at = time.monotonic()
            await swarms.node_process(settings, "spare", stub_args("4:8"))

            def served() -> set[str]:
                return {n for m in tracker.models().models for n in m.nodes}

            # "old" left the registry mid-stream; the spare joined
            await eventually(lambda: served() == {"head", "spare"}, timeout=5.0,
                             what=lambda: f"the tracker serving over head and spare only (serves: {served()})")
            second = await client.completions.create(model=MODEL, prompt="meanwhile", max_tokens=3,
                                                     temperature=0)
            route = [h["node_id"] for h in (second.model_extra or {})["swarmroute"]["route"]]
            assert route == ["head", "spare"]
            assert old.proc.poll() is None  # still serving the first stream
    assert "".join(pieces) == stub_reference(Prompt(text=prompt), n)
    await eventually(lambda: old.proc.poll() is not None, what="the drained node exiting")
    assert old.proc.returncode == 0  # exited by itself once its session was done, well before the timeout
    assert time.monotonic() - drained_at < settings.drain_timeout_s
