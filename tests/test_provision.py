"""``swarmroute node --model-id SHA256`` with an empty store (swarmroute/provision.py,
actors/provisioning/provisioner.py): nodes
on separate hosts (network namespaces, separate stores) learn the manifest from the swarm, get their layers from the
tracker, fetch only those pieces from the seeders over libtorrent, verify them and serve. Everything is real: the
bundled Gemma 3 270M, llama.cpp, nats-server, libtorrent, separate processes."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from actors.tracker import Tracker
from actors.tracker.assigner import RESERVE, fit_from_manifest
from artifacts.manifest import save_manifest
from artifacts.shard import needed_byte_ranges
from artifacts.store import Store
from artifacts.torrent import wanted_pieces
from artifacts.verify import verify_shard
from bus.identity import load_or_create
from bus.server import EmbeddedNats, NatsServerConfig
from gateway.app import Gateway
from schemas.manifest import ModelManifest
from schemas.route import ServedModel
from schemas.settings import Settings
from swarmroute import argtypes
from swarmroute.artifact_prep import import_model
from swarmroute.provision import available_memory, wants_swarm
from tests.support import netns
from tests.support.actors import ChildProcess, Children, settings_env
from tests.support.provisioned import ProgressWatch, empty_node, seeder
from tests.support.swarm import make_settings, wait_model
from tests.support.waiting import eventually

PROMPT, N_TOKENS = "The capital of France is", 24
DEFAULT_CONTEXT, DEFAULT_SESSIONS = 4096, 4
"""What an empty node declares when started without --ctx / --max-sessions (the CLI's defaults)."""


def in_ns(ns: str) -> list[str]:
    return ["ip", "netns", "exec", ns]


def needed_bytes(manifest: ModelManifest, start: int, end: int) -> int:
    return sum(hi - lo for lo, hi in needed_byte_ranges(manifest, start, end))


def wanted_bytes(manifest: ModelManifest, start: int, end: int) -> int:
    size = manifest.torrent.piece_size
    return sum(min(size, manifest.file_size - p * size)
               for p in wanted_pieces(manifest, needed_byte_ranges(manifest, start, end)))


def memory_for_two(manifest: ModelManifest) -> str:
    """A --memory too small for the whole model (so one node cannot complete a route alone) but above what half of
    it needs: computed from the same cost model the tracker uses, not assumed."""
    fit = fit_from_manifest(manifest, context=DEFAULT_CONTEXT, sessions=DEFAULT_SESSIONS, allow_unproven=False)
    whole = fit.cost(0, manifest.n_layers)
    return f"{int(0.97 * whole / (1 - RESERVE)) // 2**20}MiB"


def llama_reference(gemma_path: Path) -> str:
    import llama_cpp

    llm = llama_cpp.Llama(str(gemma_path), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    try:
        out = llm.create_completion(PROMPT, max_tokens=N_TOKENS, temperature=0.0)
        return str(out["choices"][0]["text"])  # type: ignore[index]
    finally:
        llm.close()


@contextlib.asynccontextmanager
async def separate_hosts(tmp: Path, n: int, *, subnet: int) -> AsyncIterator[
        tuple[list[tuple[str, str]], Settings, ProgressWatch, Children]]:
    """``n`` hosts (network namespace, address) on a bridge with NATS on it, the test's settings for that NATS (and
    generous timeouts: llama.cpp on a shared 2-core machine), a watch of the fetches' progress, and the children the
    test starts, all stopped at the end, children first."""
    with netns.hosts(n, subnet=subnet) as (bridge, hosts):
        server = EmbeddedNats(NatsServerConfig(store_dir=tmp / "nats", host=bridge)).start()
        # Nodes off loopback serve TLS (issue #29) and accept only the gateways they are told of, as a fleet's are.
        gateway_cert = load_or_create(tmp / "home" / "identity", "gateway").cert_file
        settings = make_settings(server.url, tmp / "home", token_timeout_s=60.0, first_token_timeout_s=120.0,
                                 hop_timeout_s=60.0, tls_trusted_certs=gateway_cert)
        watch = await ProgressWatch().start(server.url)
        children = Children()
        try:
            yield hosts, settings, watch, children
        finally:
            children.close()
            await watch.close()
            server.stop()


def seed_store(home: Path, gemma_path: Path) -> ModelManifest:
    return import_model(home, gemma_path)  # a hard link when the filesystem allows: no copy of the 253 MB


def model_of(tracker: Tracker, model_id: str) -> ServedModel | None:
    return next((m for m in tracker.models().models if m.id == model_id), None)


# ---- end to end on separate hosts ---------------------------------------------------------------------------------

@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not netns.available(), reason="needs root and ip netns (CI machines have both)")
async def test_two_empty_nodes_fetch_disjoint_ranges_and_serve_llama_cpp_text(tmp_path: Path,
                                                                             gemma_path: Path) -> None:
    """One seeder holds the GGUF; two nodes started in the same second with only --model-id get disjoint ranges that
    chain over the model, each downloads at most 1.05x what its range needs, and the route's greedy text equals
    llama-cpp-python's on the whole file."""
    expected = llama_reference(gemma_path)
    manifest = seed_store(tmp_path / "seed", gemma_path)
    mid, n = manifest.model_id, manifest.n_layers
    async with (separate_hosts(tmp_path, 3, subnet=215) as (hosts, settings, watch, children),
                Tracker(settings) as tracker, Gateway(settings, port=0) as gateway):
        (ns0, a0), *node_hosts = hosts
        children.add(seeder(settings, "seeder", tmp_path / "seed", mid, host=a0, prefix=in_ns(ns0)))
        memory = memory_for_two(manifest)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both join within the same second
            nodes = [children.add(node) for node in pool.map(lambda i: empty_node(
                settings, f"n{i}", tmp_path / f"n{i}", mid, "--memory", memory, "--threads", "1",
                "--host", node_hosts[i][1], prefix=in_ns(node_hosts[i][0])), range(2))]
        coming_up: set[str] = set()

        def serving() -> bool:
            for c in nodes:
                assert c.proc.poll() is None, f"{c.name} exited:\n{c.tail()}"
            served = model_of(tracker, mid)
            if served is not None:  # a node coming up shows in /v1/models' data, never in a route
                coming_up.update(f.node_id for f in served.fetching)
                assert not set(served.nodes) & {f.node_id for f in served.fetching}
            return all(any("ready at" in line for line in c.lines) for c in nodes)

        await eventually(serving, timeout=300, interval=0.1,
                         what=lambda: "both nodes serving:\n" + "\n".join(c.tail() for c in nodes))
        assert coming_up, "no node was ever seen in the fetching state"
        await wait_model(tracker, mid, timeout=60, n_nodes=2)

        done = {c.name: watch.last(c.name, "done") for c in nodes}
        ranges = sorted((p.start, p.end) for p in done.values())
        assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == n, ranges
        for name, p in done.items():
            need = needed_bytes(manifest, p.start, p.end)
            assert p.bytes_needed == need
            # libtorrent's own payload counter: only the range's pieces moved (piece granularity aside)
            assert need <= p.bytes_downloaded <= 1.05 * need, (name, p.bytes_downloaded, need)
            assert p.hash_failures == 0 and not p.banned_peers
            assert verify_shard(manifest, Store(tmp_path / name).shard_path(mid, p.start, p.end),
                                p.start, p.end).ok
        print("bytes", {k: (v.start, v.end, v.bytes_downloaded, v.bytes_needed) for k, v in done.items()},
              "file", manifest.file_size)

        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        result = await client.completions.create(model=mid, prompt=PROMPT, max_tokens=N_TOKENS,
                                                 temperature=0)
        assert result.choices[0].text == expected
        route = result.model_extra["swarmroute"]["route"]  # type: ignore[index]
        by_start = {p.start: name for name, p in done.items()}
        assert [h["node_id"] for h in route] == [by_start[a] for a, _ in ranges]


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not netns.available(), reason="needs root and ip netns (CI machines have both)")
async def test_killed_fetch_resumes_with_only_the_missing_pieces(tmp_path: Path, gemma_path: Path) -> None:
    """SIGKILL an empty node mid-fetch and restart it: it is given the same range again and downloads only the
    pieces the crash left missing."""
    manifest = seed_store(tmp_path / "seed", gemma_path)
    mid = manifest.model_id
    async with (separate_hosts(tmp_path, 2, subnet=216) as (hosts, settings, watch, children),
                Tracker(settings)):
        (ns0, a0), (ns1, a1) = hosts
        # a throttled seeder, so that the kill lands mid-fetch
        children.add(seeder(settings, "seeder", tmp_path / "seed", mid, host=a0, prefix=in_ns(ns0),
                            extra=["--upload-limit", "25000000"]))
        args = ["--memory", memory_for_two(manifest), "--threads", "1", "--host", a1]
        first = children.add(empty_node(settings, "n1", tmp_path / "n1", mid, *args, prefix=in_ns(ns1)))

        def far_enough() -> bool:
            return any(p.phase == "fetching" and p.pieces_done >= 0.4 * p.pieces_wanted > 0
                       for p in watch.of("n1"))

        await eventually(far_enough, timeout=120, what="n1 fetching 40% of its pieces (on NATS)")
        first.kill()
        before = watch.of("n1")
        held = max(p.pieces_done for p in before)
        start, end = before[-1].start, before[-1].end
        wanted = max(p.pieces_wanted for p in before)
        assert held < wanted, "the fetch finished before the kill"
        seen = len(watch.events)

        second = children.add(empty_node(settings, "n1", tmp_path / "n1", mid, *args, prefix=in_ns(ns1)))
        await asyncio.to_thread(second.ready, 300)
        after = [p for p in watch.events[seen:] if p.node_id == "n1"]
        done = [p for p in after if p.phase == "done"][-1]
        assert (done.start, done.end) == (start, end), "the restart was given another range"
        assert verify_shard(manifest, Store(tmp_path / "n1").shard_path(mid, start, end), start, end).ok
        piece = manifest.torrent.piece_size
        # only what the crash left missing moved again (a few pieces in flight at the kill may be lost)
        assert done.bytes_downloaded <= wanted_bytes(manifest, start, end) - (held - 8) * piece, (
            done.bytes_downloaded, held, wanted)
        print("resume: held", held, "of", wanted, "pieces at the kill; restart downloaded",
              done.bytes_downloaded, "of", wanted_bytes(manifest, start, end))


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not netns.available(), reason="needs root and ip netns (CI machines have both)")
async def test_corrupt_seeder_is_banned_and_named_and_a_node_waits_for_an_honest_one(tmp_path: Path,
                                                                                    gemma_path: Path) -> None:
    """A seeder that serves corrupt pieces is the only one at first: the node bans it, names it in its log and in
    its FetchProgress, says which layers nobody seeds and waits, unrouted; an honest seeder joins and the node ends
    verified and serving."""
    manifest = seed_store(tmp_path / "seed", gemma_path)
    mid = manifest.model_id
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copyfile(gemma_path, bad / manifest.torrent.file_name)
    with (bad / manifest.torrent.file_name).open("r+b") as f:  # one flipped byte in every piece: all of it lies
        for piece in range(manifest.torrent.n_pieces):
            f.seek(piece * manifest.torrent.piece_size + 17)
            b = f.read(1)
            f.seek(piece * manifest.torrent.piece_size + 17)
            f.write(bytes([b[0] ^ 0xFF]))
    manifest_file = save_manifest(manifest, tmp_path / "manifest.json")
    async with (separate_hosts(tmp_path, 3, subnet=217) as (hosts, settings, watch, children),
                Tracker(settings) as tracker):
        (ns0, a0), (ns1, a1), (ns2, a2) = hosts
        liar = children.add(ChildProcess(
            [*in_ns(ns0), sys.executable, "-m", "tests.support.corrupt_peer", str(manifest_file), str(bad),
             "--host", a0, "--nats", settings.nats_url, "--node-id", "liar"], env=settings_env(settings)))
        liar_port = liar.wait_for(r'"port": (\d+)', 60).group(1)
        liar_address = f"{a0}:{liar_port}"
        liar_name = f"liar ({liar_address})"  # the node id its announcements carry, and where it serves
        node = children.add(empty_node(settings, "n1", tmp_path / "n1", mid, "--layers", "6:12",
                                       "--threads", "1", "--host", a2, prefix=in_ns(ns2)))

        def waiting() -> bool:
            return any(p.banned_peers and p.unseeded_layers for p in watch.of("n1"))

        await eventually(waiting, timeout=120, what="n1 banning the liar, then waiting for a seeder (on NATS)")
        stalled = next(p for p in watch.of("n1") if p.banned_peers and p.unseeded_layers)
        assert stalled.banned_peers == [liar_name] and stalled.hash_failures >= 1
        assert {(r.start, r.end) for r in stalled.unseeded_layers} == {(6, 12)}
        assert "layers [6, 12)" in stalled.message
        served = model_of(tracker, mid)
        assert served is not None and [f.node_id for f in served.fetching] == ["n1"] and not served.nodes
        node.wait_for(rf"peer {re.escape(liar_name)} banned", 10)  # named in its log
        node.wait_for(r"waiting for a peer that has layers \[6, 12\)", 10)

        children.add(seeder(settings, "seeder", tmp_path / "seed", mid, host=a1, prefix=in_ns(ns1)))
        await asyncio.to_thread(node.ready, 300)
        done = watch.last("n1", "done")
        assert (done.start, done.end) == (6, 12)
        assert done.banned_peers == [liar_name] and done.hash_failures >= 1
        assert verify_shard(manifest, Store(tmp_path / "n1").shard_path(mid, 6, 12), 6, 12).ok

        def serving() -> bool:  # the tracker's registry watch follows the node's first heartbeat
            served = model_of(tracker, mid)
            return served is not None and served.nodes == ["n1"] and not served.fetching

        await eventually(serving, timeout=30, what=lambda: f"the tracker seeing n1 serving: {model_of(tracker, mid)}")


# ---- the command line ---------------------------------------------------------------------------------------------

def test_only_a_content_id_without_a_file_fetches_from_the_swarm() -> None:
    def ns(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"backend": "llamacpp", "model": None, "model_id": None, **kw})

    sha = "a" * 64
    assert wants_swarm(ns(model_id=sha))
    assert not wants_swarm(ns(model_id="gemma"))  # a name to advertise, as before
    assert not wants_swarm(ns(model_id=sha, model="/models/x.gguf"))  # a local file wins
    assert not wants_swarm(ns(model_id=sha, backend="stub"))
    assert not wants_swarm(ns(model_id=sha.upper()))


def test_default_memory_is_what_the_machine_has_available(tmp_path: Path) -> None:
    value = available_memory()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < value <= total


def test_memory_option_needs_a_unit() -> None:
    assert argtypes.size("512MiB") == 512 * 2**20
    assert argtypes.size("24GB") == 24 * 2**30
    for bad in ("512", "2x24GB", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            argtypes.size(bad)
