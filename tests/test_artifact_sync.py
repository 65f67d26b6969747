"""The artifact swarm as separate processes on loopback: a real nats-server, ``artifact seed`` / ``artifact fetch``
CLI processes (libtorrent inside), and a dishonest peer. The test watches NATS like an operator would."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from artifacts.manifest import save_manifest
from artifacts.shard import needed_byte_ranges
from artifacts.store import Store
from artifacts.verify import verify_shard
from bus.codec import decode
from bus.server import EmbeddedNats
from bus.subjects import Subjects
from schemas.artifact import ArtifactPeer, FetchProgress
from schemas.manifest import ModelManifest
from tests.support.actors import ChildProcess, Children, swarmroute
from tests.support.gguf_factory import write_tiny_gguf
from tests.support.swarm import Swarms
from tests.support.waiting import eventually

REPO = Path(__file__).resolve().parent.parent
CORRUPT_PEER = REPO / "tests" / "support" / "corrupt_peer.py"
SUBJECTS = Subjects()


class Proc(ChildProcess):
    """A child process whose JSON stdout lines are read in the background; stderr goes to a log file."""

    stop_timeout = 15.0

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._err = log.open("w")
        self.json_lines: queue.Queue[dict[str, object]] = queue.Queue()
        super().__init__(argv, env_replace=env, cwd=REPO, stderr=self._err)

    def on_line(self, line: str) -> None:
        if line.startswith("{"):
            self.json_lines.put(json.loads(line))

    def next_json(self, timeout: float) -> dict[str, object]:
        try:
            return self.json_lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output in {timeout}s (rc={self.proc.poll()}): {self.log.read_text()[-2000:]}"
                                 ) from None

    async def json(self, timeout: float) -> dict[str, object]:
        """``next_json`` without blocking the event loop (NATS callbacks keep running meanwhile)."""
        return await asyncio.to_thread(self.next_json, timeout)

    def close(self) -> None:
        self.stop()
        self._err.close()


class Swarm:
    def __init__(self, tmp: Path, nats_url: str, children: Children) -> None:
        self.tmp = tmp
        self.env = {**os.environ, "SWARMROUTE_NATS_URL": nats_url, "PYTHONPATH": str(REPO)}
        self.children = children

    def artifact(self, name: str, *args: str) -> Proc:
        return self.children.add(Proc(swarmroute("artifact", *args, "--node-id", name), self.env,
                                      self.tmp / f"{name}.log"))

    async def seed(self, name: str, home: Path, model_id: str) -> tuple[Proc, dict[str, object]]:
        proc = self.artifact(name, "seed", model_id, "--home", str(home))
        return proc, await proc.json(120)

    def fetch(self, name: str, home: Path, *args: str) -> Proc:
        return self.artifact(name, "fetch", "--home", str(home), "--quiet", *args)

    async def corrupt_peer(self, manifest: Path, directory: Path, *args: str) -> int:
        proc = self.children.add(Proc([sys.executable, str(CORRUPT_PEER), str(manifest), str(directory), *args],
                                      self.env, self.tmp / "corrupt.log"))
        port = (await proc.json(60))["port"]
        assert isinstance(port, int)
        return port


@pytest.fixture
def swarm(tmp_path: Path, nats_server: EmbeddedNats, children: Children) -> Swarm:
    return Swarm(tmp_path, nats_server.url, children)


class Watch:
    """Everything published on the artifact subjects of one model, decoded."""

    def __init__(self) -> None:
        self.peers: list[ArtifactPeer] = []
        self.progress: list[FetchProgress] = []

    async def start(self, url: str, model_id: str) -> Watch:
        self.nc = await nats.connect(url)

        async def on_peer(msg: Msg) -> None:
            self.peers.append(decode(msg.data, ArtifactPeer))

        async def on_progress(msg: Msg) -> None:
            self.progress.append(decode(msg.data, FetchProgress))

        await self.nc.subscribe(SUBJECTS.artifact_peers(model_id), cb=on_peer)
        await self.nc.subscribe(SUBJECTS.artifact_progress("*"), cb=on_progress)
        return self

    def ranges_of(self, node_id: str) -> list[list[tuple[int, int]]]:
        return [[(r.start, r.end) for r in p.ranges] for p in self.peers if p.node_id == node_id]

    async def close(self) -> None:
        await self.nc.drain()


def seed_store(home: Path, source: Path) -> ModelManifest:
    return Store(home).import_gguf(source)


def wanted_bytes(manifest: ModelManifest, start: int, end: int) -> int:
    size = manifest.torrent.piece_size
    pieces = {p for lo, hi in needed_byte_ranges(manifest, start, end) for p in range(lo // size, (hi - 1) // size + 1)}
    return sum(min(size, manifest.file_size - p * size) for p in pieces)


def flip_in_tensors(path: Path, manifest: ModelManifest, names: list[str]) -> None:
    with path.open("r+b") as f:
        for name in names:
            t = manifest.tensor(name)
            f.seek(t.offset + t.size // 2)
            b = f.read(1)
            f.seek(t.offset + t.size // 2)
            f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def gemma_copy(gemma_path: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "gemma.gguf"
    shutil.copyfile(gemma_path, copy)  # stores below may be corrupted on purpose: never touch the cached model
    return copy


@pytest.mark.slow
async def test_two_leechers_fetch_their_ranges_and_advertise_only_them(
        swarm: Swarm, nats_server: EmbeddedNats, swarms: Swarms, gemma_copy: Path, tmp_path: Path) -> None:
    manifest = seed_store(tmp_path / "h0", gemma_copy)
    mid = manifest.model_id
    watch = await Watch().start(nats_server.url, mid)
    swarms.on_teardown(watch.close)
    _, seeding = await swarm.seed("seed0", tmp_path / "h0", mid)
    assert seeding["ranges"] == [[0, 18]]
    splits = {"leechA": (0, 9), "leechB": (9, 18)}
    # only the model id: each leecher gets the manifest from the swarm over NATS
    procs = {n: swarm.fetch(n, tmp_path / n, "--model-id", mid, "--range", f"{a}:{b}", "--seed-after")
             for n, (a, b) in splits.items()}
    results = {n: FetchProgress.model_validate(await p.json(300)) for n, p in procs.items()}
    await eventually(lambda: all([r] in watch.ranges_of(n) for n, r in splits.items()), timeout=10,
                     what="both leechers advertising their ranges")
    for node, (a, b) in splits.items():
        r = results[node]
        assert r.model_extra is not None and r.model_extra["event"] == "fetched" and r.phase == "done"
        assert verify_shard(manifest, Path(r.model_extra["shard"]), a, b).ok
        assert r.bytes_needed == sum(hi - lo for lo, hi in needed_byte_ranges(manifest, a, b))
        assert r.bytes_needed <= r.bytes_downloaded <= 1.02 * wanted_bytes(manifest, a, b)
        # every announcement: nothing before the range verified, then exactly that range
        assert all(ranges in ([], [(a, b)]) for ranges in watch.ranges_of(node))
        phases = [p.phase for p in watch.progress if p.node_id == node]
        assert "fetching" in phases and phases[-1] == "done"
    assert watch.ranges_of("seed0") and all(ranges == [(0, 18)] for ranges in watch.ranges_of("seed0"))
    # a 2-way split moves 2 x ~219 MB: the 178 MB tied embedding is needed by both the head and the tail
    print("downloaded", {n: r.bytes_downloaded for n, r in results.items()}, "file", manifest.file_size)


async def test_flipped_byte_is_detected_and_never_advertised(swarm: Swarm, nats_server: EmbeddedNats, swarms: Swarms,
                                                             tmp_path: Path) -> None:
    source = write_tiny_gguf(tmp_path / "tiny.gguf", n_layers=6)
    manifest = seed_store(tmp_path / "h0", source)
    store = Store(tmp_path / "h0")
    flip_in_tensors(store.data_path(manifest), manifest, ["blk.2.attn_v.weight"])
    watch = await Watch().start(nats_server.url, manifest.model_id)
    swarms.on_teardown(watch.close)
    _, seeding = await swarm.seed("seed0", tmp_path / "h0", manifest.model_id)
    assert seeding["ranges"] == [[0, 2], [3, 6]]
    await eventually(lambda: watch.ranges_of("seed0"), timeout=10,
                     what="the seeder advertising")
    assert all(not any(a <= 2 < b for a, b in ranges) for ranges in watch.ranges_of("seed0"))
    out = subprocess.run([sys.executable, "-m", "swarmroute", "artifact", "verify", "--home", str(tmp_path / "h0")],
                         capture_output=True, text=True, cwd=REPO, env=swarm.env)
    assert out.returncode == 1 and "hash_mismatch: blk.2.attn_v.weight" in out.stdout


@pytest.mark.slow
async def test_interrupted_fetch_resumes(swarm: Swarm, nats_server: EmbeddedNats, swarms: Swarms, gemma_copy: Path,
                                         tmp_path: Path) -> None:
    manifest = seed_store(tmp_path / "h0", gemma_copy)
    mid = manifest.model_id
    watch = await Watch().start(nats_server.url, mid)
    swarms.on_teardown(watch.close)
    await swarm.seed("seed0", tmp_path / "h0", mid)
    wanted = wanted_bytes(manifest, 6, 12)
    first = swarm.fetch("leech", tmp_path / "h1", "--model-id", mid, "--range", "6:12",
                        "--download-limit", "3000000")

    def far_enough() -> bool:
        return any(p.node_id == "leech" and p.pieces_done >= 0.4 * p.pieces_wanted > 0 for p in watch.progress)

    await eventually(far_enough, timeout=60,
                     what="the leecher fetching 40% of its pieces")
    first.kill()  # SIGKILL, a crash: no chance to save anything
    held = max(p.pieces_done for p in watch.progress if p.node_id == "leech")
    assert held < max(p.pieces_wanted for p in watch.progress if p.node_id == "leech")
    second = FetchProgress.model_validate(
        await swarm.fetch("leech", tmp_path / "h1", "--model-id", mid, "--range", "6:12").json(120))
    assert second.phase == "done" and second.model_extra is not None
    assert verify_shard(manifest, Path(second.model_extra["shard"]), 6, 12).ok
    piece = manifest.torrent.piece_size
    # the restart fetched only what the crash left missing (a few in-flight pieces may be lost)
    assert second.bytes_downloaded <= wanted - (held - 8) * piece


@pytest.mark.slow
async def test_corrupt_peer_is_survived(swarm: Swarm, nats_server: EmbeddedNats, swarms: Swarms, gemma_copy: Path,
                                        tmp_path: Path) -> None:
    manifest = seed_store(tmp_path / "h0", gemma_copy)
    mid = manifest.model_id
    manifest_file = save_manifest(manifest, tmp_path / "manifest.json")
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    shutil.copyfile(gemma_copy, bad_dir / manifest.torrent.file_name)
    flip_in_tensors(bad_dir / manifest.torrent.file_name, manifest,
                    [n for il in range(6, 12) for n in manifest.groups.layers[il]])
    bad_port = await swarm.corrupt_peer(manifest_file, bad_dir)
    watch = await Watch().start(nats_server.url, mid)
    swarms.on_teardown(watch.close)
    leech = swarm.fetch("leech", tmp_path / "h1", "--manifest", str(manifest_file), "--range", "6:12",
                        "--peer", f"127.0.0.1:{bad_port}")
    # at first the liar is the only peer: wait until its data has failed the piece hashes
    await eventually(lambda: any(p.node_id == "leech" and p.hash_failures for p in watch.progress), timeout=60,
                     what="a hash failure on the leecher")
    await swarm.seed("seed0", tmp_path / "h0", mid)  # an honest seeder joins, found over NATS
    result = FetchProgress.model_validate(await leech.json(120))
    assert result.phase == "done" and result.hash_failures >= 1 and result.model_extra is not None
    assert verify_shard(manifest, Path(result.model_extra["shard"]), 6, 12).ok
    assert result.banned_peers == [f"127.0.0.1:{bad_port}"]  # a static --peer announced nothing: its address only


@pytest.mark.slow
async def test_a_corrupt_peer_that_announced_itself_is_named_by_its_node_id(
        swarm: Swarm, nats_server: EmbeddedNats, swarms: Swarms, gemma_copy: Path, tmp_path: Path) -> None:
    """The liar joins the artifact swarm like a seeder (announcements, peer queries, the manifest): the fetcher
    finds it over NATS, bans it, and names it in its progress as ``node-id (HOST:PORT)``."""
    manifest = seed_store(tmp_path / "h0", gemma_copy)
    mid = manifest.model_id
    manifest_file = save_manifest(manifest, tmp_path / "manifest.json")
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    shutil.copyfile(gemma_copy, bad_dir / manifest.torrent.file_name)
    flip_in_tensors(bad_dir / manifest.torrent.file_name, manifest,
                    [n for il in range(6, 12) for n in manifest.groups.layers[il]])
    bad_port = await swarm.corrupt_peer(manifest_file, bad_dir, "--nats", nats_server.url, "--node-id", "liar")
    watch = await Watch().start(nats_server.url, mid)
    swarms.on_teardown(watch.close)
    await eventually(lambda: any(p.node_id == "liar" for p in watch.peers), timeout=30,
                     what="the liar announcing itself")
    leech = swarm.fetch("leech", tmp_path / "h1", "--model-id", mid, "--range", "6:12")  # no --peer: NATS only
    named = f"liar (127.0.0.1:{bad_port})"
    await eventually(lambda: any(p.node_id == "leech" and named in p.banned_peers for p in watch.progress),
                     timeout=90, what=f"the leecher banning {named!r}")
    await swarm.seed("seed0", tmp_path / "h0", mid)  # an honest seeder joins
    # 120 s ran out once in a full suite run (2026-12-03, the leecher silent after its ban; ~7 s alone): more room,
    # so a slow reconnect under the suite's load is told apart from a hang.
    result = FetchProgress.model_validate(await leech.json(300))
    assert result.phase == "done" and result.hash_failures >= 1 and result.model_extra is not None
    assert verify_shard(manifest, Path(result.model_extra["shard"]), 6, 12).ok
    assert result.banned_peers == [named]
