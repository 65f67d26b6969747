"""Growing a running ``swarmroute up`` (issue #27 item 1): ``up`` serves the bundled model from the local file and its
nodes seed it, so a node started with only the model id that ``/v1/models`` lists learns the manifest from them,
is assigned a range by the tracker, fetches just those pieces from them (there is no seeder) and serves exact text.
Everything real and separate processes, as a user runs it: ``swarmroute up``, ``swarmroute node``, nats-server,
libtorrent on loopback, llama.cpp, the official client; the reference is llama.cpp in one process."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from actors.tracker.assigner import RESERVE, fit_from_manifest
from artifacts.shard import needed_byte_ranges
from artifacts.store import Store
from tests.support.actors import ChildProcess, Children, swarmroute
from tests.support.leecher import Leecher
from tests.support.up import Up, free_port
from tests.support.waiting import eventually_sync

pytestmark = pytest.mark.slow
MODEL = "gemma-3-270m"
N_TOKENS = 24
PROMPTS = ("The capital of France is", "Once upon a time, in a small village,", "The three primary colors are",
           "A recipe for bread: first,")
READY_S = 900.0
"""How long ``up`` or a joining node may take to serve, llama.cpp included, on a shared 2-core machine."""


@pytest.fixture(scope="module")
def reference(gemma_path: Path) -> dict[str, str]:
    """Greedy text of every prompt from llama.cpp in one process."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gemma_path), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    texts = {}
    try:
        for prompt in PROMPTS:
            llm.reset()  # no prefix reuse from the previous prompt: each is prefilled whole, as the route does
            texts[prompt] = str(llm.create_completion(prompt, max_tokens=N_TOKENS, temperature=0.0)
                                ["choices"][0]["text"])  # type: ignore[index]
    finally:
        llm.close()
    return texts


class HomeUp(Up):
    """``swarmroute up`` with its home (where its nodes' store is) and its NATS URL."""

    def __init__(self, home: Path) -> None:
        self.home = home
        super().__init__("--threads", "1", "--log-level", "info",
                         env={"SWARMROUTE_HOME": str(home), "SWARMROUTE_GATEWAY_PORT": str(free_port())})

    @property
    def nats_url(self) -> str:
        found = re.search(r"NATS\s+(nats://\S+)", self.output)
        assert found, self.output
        return found.group(1)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HomeUp]:
    """``swarmroute up`` as the README starts it (2 nodes from the local file), one thread per node."""
    running = HomeUp(tmp_path_factory.mktemp("up") / "home")
    try:
        assert running.banner.wait(READY_S), running.output
        assert running.proc.poll() is None, running.output
        eventually_sync(lambda: running.output.count("seeds every piece of model") == 2, timeout=300,
                        what=lambda: f"both nodes seeding every piece:\n{running.output}")
        yield running
    finally:
        running.close()


def models(up: HomeUp) -> list[dict[str, Any]]:
    with urllib.request.urlopen(up.gateway_url() + "/v1/models", timeout=10) as r:
        data: list[dict[str, Any]] = json.load(r)["data"]
    return data


def torrent_address(up: HomeUp, node: str) -> str:
    found = re.search(rf"\[{node}\].*node {node} seeds model \w+ from (\S+) ", up.output)
    assert found, up.output
    return found.group(1)


def stream(up: HomeUp, prompt: str) -> tuple[str, list[str]]:
    """The streamed greedy text and the route's node ids (the first chunk's telemetry)."""
    client = openai.OpenAI(base_url=up.gateway_url() + "/v1", api_key="none", max_retries=0, timeout=300)
    text, route = "", []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                           stream=True):
        telemetry = (chunk.model_extra or {}).get("swarmroute") or {}
        route = route or [hop["node_id"] for hop in telemetry.get("route") or []]
        if chunk.choices:
            text += chunk.choices[0].text
    return text, route


def test_nodes_seeding_under_load_keep_their_sessions_output_unchanged(up: HomeUp, reference: dict[str, str],
                                                                       tmp_path: Path) -> None:
    """Both nodes upload the whole model to a peer, at the full default rate, while sessions decode through them."""
    manifest = Store(up.home).manifest_path(models(up)[0]["id"])
    leechers = [Leecher(manifest, torrent_address(up, node), tmp_path / node) for node in ("node-1", "node-2")]
    try:
        for leecher in leechers:
            leecher.wait_downloading()
        before = [leecher.received for leecher in leechers]
        for prompt in PROMPTS:
            text, route = stream(up, prompt)
            assert route == ["node-1", "node-2"]
            assert text == reference[prompt], prompt
        eventually_sync(lambda: all(leecher.received > b for leecher, b in zip(leechers, before, strict=True)),
                        timeout=30, what="both nodes uploading while their sessions decoded")
        assert all(leecher.proc.poll() is None for leecher in leechers)
    finally:
        for leecher in leechers:
            leecher.stop()


def test_a_node_started_with_only_the_model_id_joins_a_running_up_and_serves_exact_text(
        up: HomeUp, reference: dict[str, str], tmp_path: Path, children: Children) -> None:
    listed = models(up)[0]
    model_id, nats_url = listed["id"], up.nats_url
    manifest = Store(up.home).load(model_id)
    fit = fit_from_manifest(manifest, context=4096, sessions=4, allow_unproven=False)
    memory = f"{int(0.97 * fit.cost(0, manifest.n_layers) / (1 - RESERVE)) // 2**20}MiB"  # a replica, not all
    node = children.add(ChildProcess(swarmroute("node", "--nats", nats_url, "--model-id", model_id, "--memory", memory,
                                                "--home", str(tmp_path / "node-3"), "--node-id", "node-3",
                                                "--threads", "1")))
    node.wait_for(r"node node-3 ready at", READY_S)
    got = re.search(r"layers \[(\d+), (\d+)\) of \w+ verified: (\d+) bytes downloaded", "\n".join(node.lines))
    assert got, node.tail()
    start, end, downloaded = (int(g) for g in got.groups())
    needed = sum(hi - lo for lo, hi in needed_byte_ranges(manifest, start, end))
    assert needed <= downloaded <= 1.05 * needed, "only its range's pieces, from up's nodes (there is no seeder)"
    twin = {(0, 9): "node-1", (9, 18): "node-2"}[(start, end)]
    eventually_sync(lambda: "node-3" in models(up)[0]["nodes"], timeout=60, what=lambda: models(up))
    paused = up.child("node", twin)
    os.kill(paused, signal.SIGSTOP)  # out of the registry when its heartbeats stop: every route needs node-3
    try:
        eventually_sync(lambda: twin not in models(up)[0]["nodes"], timeout=60, what=lambda: models(up))
        for prompt in PROMPTS:
            text, route = stream(up, prompt)
            assert "node-3" in route and twin not in route, route
            assert text == reference[prompt], prompt
    finally:
        os.kill(paused, signal.SIGCONT)
    node.stop(signal.SIGTERM, timeout=60)
