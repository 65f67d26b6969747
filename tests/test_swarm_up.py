"""``swarmroute up --from-swarm`` (swarmroute/swarm_up.py): one seeder with the GGUF and N nodes that start empty,
on one machine, each with its own store, as the demonstration of the whole provisioning path."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import openai
import pytest

from artifacts.manifest import build_manifest
from schemas.errors import BadRequestError
from swarmroute.swarm_up import memory_for, nodes_needed
from tests.support.actors import Children, descendants, still_alive
from tests.support.up import Up, free_port
from tests.support.waiting import eventually_sync

CONTEXT, SESSIONS = 4096, 4


@pytest.mark.slow
def test_the_node_memory_makes_the_tracker_split_over_exactly_n_nodes(gemma_path: Path) -> None:
    manifest = build_manifest(gemma_path)
    for n in (1, 2, 3):
        memory = memory_for(manifest, n, context=CONTEXT, sessions=SESSIONS)
        assert nodes_needed(manifest, memory, context=CONTEXT, sessions=SESSIONS, limit=10) == n
    # the 178 MB tied embedding sits on the head and the tail: any node that holds one also holds all middle layers
    with pytest.raises(BadRequestError, match="over exactly 4 nodes"):
        memory_for(manifest, 4, context=CONTEXT, sessions=SESSIONS)


@pytest.mark.slow
def test_up_from_swarm_serves_from_nodes_that_fetched_only_their_layers(tmp_path: Path, gemma_path: Path,
                                                                        children: Children) -> None:
    home = tmp_path / "home"
    up = children.add(Up("--nodes", "2", "--from-swarm", "--model", str(gemma_path), "--log-level", "info",
                         env={"SWARMROUTE_HOME": str(home), "SWARMROUTE_GATEWAY_PORT": str(free_port()),
                              "SWARMROUTE_CORE_SHARE_CACHE": str(tmp_path / "core-share.json")}))
    assert up.banner.wait(300), up.output
    assert up.proc.poll() is None, up.output
    assert "2 nodes that started empty" in up.output
    # Their threads were measured on this CPU with the seeder's copy of the model (issue #26), as plain up does.
    share = re.search(r"swarmroute up: (\d+) threads? per node(, passive wait)? \(.*measured now on this CPU",
                      up.output)
    assert share is not None and (tmp_path / "core-share.json").is_file(), up.output
    for name in ("node-1", "node-2"):
        pid = up.child("node", name)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        assert argv[argv.index("--threads") + 1] == share.group(1), argv
        assert ("OMP_WAIT_POLICY=passive" in environ) == bool(share.group(2)), environ
    fetched = re.findall(r"\[(node-\d)\].*layers \[(\d+), (\d+)\) of \w+ verified: (\d+) bytes downloaded for "
                         r"(\d+) needed", up.output)
    assert sorted(f[0] for f in fetched) == ["node-1", "node-2"], up.output
    ranges = sorted((int(a), int(b)) for _, a, b, _, _ in fetched)
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 18
    for _, _, _, downloaded, needed in fetched:
        assert int(needed) <= int(downloaded) <= 1.05 * int(needed)
    manifest = build_manifest(gemma_path)
    for node in ("node-1", "node-2"):  # each store holds its pieces only: a sparse file, not a copy
        data = home / "up-swarm" / node / "store" / manifest.model_id / "model.gguf"
        assert data.stat().st_blocks * 512 < 0.95 * manifest.file_size
    client = openai.OpenAI(base_url=up.gateway_url() + "/v1", api_key="none", max_retries=0, timeout=120)
    text = client.completions.create(model="gemma-3-270m", prompt="The capital of France is", max_tokens=8,
                                     temperature=0).choices[0].text
    assert text.strip()
    below = descendants(up.proc.pid)
    os.kill(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(60) == 0, up.output
    eventually_sync(lambda: not still_alive(below), timeout=15, interval=0.1,
                    what=lambda: f"every child exiting (alive: {still_alive(below)})")
