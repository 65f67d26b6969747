"""The beta on DeepSeek V4 (issue #25), on the tiny V4 of the matrix in real ``swarmroute node`` processes behind a
real tracker, gateway and nats-server:

* kill the middle node of a 3-node route mid-decode with a spare serving its layers running: the greedy text is
  the text of a run without the fault. V4's cache moves only whole sequences (``kv_state.KvCells.whole_sequences``):
  every snapshot is the session's whole KV up to its boundary, the replacement imports it into an empty session
  and the hop before it replays its journal from there;
* prefix reuse is refused for V4 (a V4 sequence cannot be cut back to a shared prefix): a second request with the
  same prompt starts cold and gives the same text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.tracker import Tracker
from artifacts.synthetic.matrix import case
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.arch_matrix import build
from tests.support.deepseek4 import PREFILL_CHUNK, PROMPT
from tests.support.swarm import NodeProcess, Swarms, make_settings, wait_model
from tests.test_llamacpp_repair import assert_repaired, freed, stream

pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.slow
MODEL = "gemma"  # the name tests.test_llamacpp_repair.stream asks the gateway for
V4 = case("deepseek4")


@pytest.fixture
def settings(nats_server: Any, tmp_path: Path) -> Settings:
    return make_settings(nats_server.url, tmp_path / "home", token_timeout_s=30.0, first_token_timeout_s=60.0,
                         hop_timeout_s=30.0, snapshot_every=8, repair_timeout_s=60.0, prefill_chunk=PREFILL_CHUNK)


@pytest.fixture
def v4_path(tmp_path: Path) -> Path:
    return build(V4, "F16", tmp_path)


async def start(settings: Settings, swarms: Swarms, path: Path,
                layout: list[tuple[str, str]]) -> tuple[dict[str, NodeProcess], Gateway]:
    args = ["--backend", "llamacpp", "--model", str(path), "--model-id", MODEL, "--threads", "1", "--ctx", "1024",
            "--max-sessions", "2"]
    nodes = {name: await swarms.node_process(settings, name, [*args, "--layers", layers]) for name, layers in layout}
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, MODEL, timeout=120, n_nodes=len(layout))
    return nodes, gateway


async def test_a_killed_middle_node_mid_decode_is_replaced_and_the_text_is_unchanged(
        settings: Settings, swarms: Swarms, v4_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.test_llamacpp_repair.PROMPT", PROMPT)
    nodes, gateway = await start(settings, swarms, v4_path,
                                 [("head", "0:3"), ("middle", "3:6"), ("tail", "6:10"), ("spare", "3:6")])
    expected, _, _ = await stream(gateway, max_tokens=32)
    text, snaps, dead = await stream(gateway, max_tokens=32, kill=nodes, hop=1, after_tokens=16)
    assert dead and text == expected
    assert_repaired(snaps, dead, 1, "snapshot")
    assert snaps[-1]["repair"]["snapshot_positions"] > 0
    await freed(nodes, dead)
