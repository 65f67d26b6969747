"""The unproven-architecture override (``--allow-unproven-architecture``) through the command line, and a node's own
override deciding what it verifies, serves, seeds and repairs: a shard of an architecture the matrix has not proven
is refused without it (whoever cut the shard, and wherever it came from) and accepted with it."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from actors.provisioning.artifact_sync import ArtifactSync, SyncConfig
from artifacts import arch_support
from artifacts.arch_support import SUPPORT
from artifacts.gguf_layout import read_layout
from artifacts.shard import ShardSource, write_shard
from artifacts.store import Store
from artifacts.synthetic.architectures import BUILDERS, Dims
from artifacts.torrent import TorrentSession
from artifacts.verify import verify_shard, verify_store
from schemas.errors import ArtifactError, BadRequestError
from schemas.manifest import ModelManifest
from schemas.settings import Settings
from swarmroute.artifact_prep import prepare
from swarmroute.cli import build_parser, main
from tests.support.gguf_factory import write_unproven_gguf

FLAG = "--allow-unproven-architecture"


def run(argv: list[str]) -> tuple[int, str, str]:
    """``swarmroute <argv>`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def refused_as_unproven(message: str) -> bool:
    return "'olmo' is not proven to route bit-exactly" in message and "unproven-architecture override" in message


@pytest.fixture
def olmo(tmp_path: Path) -> Path:
    return write_unproven_gguf(tmp_path / "olmo.gguf", n_layers=4)


@pytest.fixture
def stored(tmp_path: Path, olmo: Path) -> tuple[Path, ModelManifest]:
    """A home whose store holds the olmo model and a shard [1, 3) cut by someone who accepted the risk."""
    home = tmp_path / "home"
    store = Store(home)
    manifest = store.import_gguf(olmo)
    write_shard(ShardSource.from_manifest(manifest, store.data_path(manifest)),
                store.shard_path(manifest.model_id, 1, 3), 1, 3, allow_unproven=True)
    return home, manifest


# --- the flag through the command line ----------------------------------------------------------------------------


def test_artifact_shard_from_a_file_is_refused_without_the_flag_and_cut_with_it(tmp_path: Path, olmo: Path) -> None:
    out = tmp_path / "o.gguf"
    status, _, err = run(["artifact", "shard", "--source", str(olmo), "--range", "1:3", "--out", str(out)])
    assert status == 2 and refused_as_unproven(err), err
    assert str(olmo) in err and "[1, 3)" in err
    assert not out.exists()
    status, printed, err = run(["artifact", "shard", "--source", str(olmo), "--range", "1:3", "--out", str(out), FLAG])
    assert status == 0, err
    assert printed.strip() == str(out) and read_layout(out).value("swarmroute.layer_start") == 1


def test_artifact_shard_and_verify_of_a_stored_model_follow_the_flag(tmp_path: Path, olmo: Path) -> None:
    home = str(tmp_path / "home")
    status, printed, err = run(["artifact", "build", str(olmo), "--home", home])
    assert status == 0, err
    model_id = json.loads(printed)["model_id"]
    status, _, err = run(["artifact", "shard", model_id, "--range", "1:3", "--home", home])
    assert status == 2 and refused_as_unproven(err), err
    status, printed, err = run(["artifact", "shard", model_id, "--range", "1:3", "--home", home, FLAG])
    assert status == 0 and "ok" in printed, printed + err
    # The shard is there now, cut by a user who accepted the risk; verifying it is that user's choice again.
    status, printed, _ = run(["artifact", "verify", model_id, "--range", "1:3", "--home", home])
    assert status == 1 and "not proven" in printed and "can serve: [0, 4)" in printed, printed
    status, printed, _ = run(["artifact", "verify", model_id, "--range", "1:3", "--home", home, FLAG])
    assert status == 0 and "can serve: [0, 4), [1, 3)" in printed, printed


def test_every_command_that_cuts_verifies_or_seeds_takes_the_flag() -> None:
    parser = build_parser()
    for argv in (["node"], ["up"], ["artifact", "shard", "--range", "0:1"], ["artifact", "fetch"],
                 ["artifact", "verify"], ["artifact", "seed", "m"], ["seeder", "m"]):
        assert parser.parse_args(argv).allow_unproven_architecture is False, argv
        assert parser.parse_args([*argv, FLAG]).allow_unproven_architecture is True, argv


@pytest.mark.slow
def test_a_node_cuts_and_loads_an_unproven_architecture_only_with_the_flag(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``swarmroute node --model M --layers 2:4``, as parsed from its command line, on a model llama.cpp runs: a
    tiny llama, made an architecture the matrix has not proven by taking llama out of the table."""
    pytest.importorskip("llama_cpp")  # a skip fails under CI=true (tests/support/ci_strict.py)
    from actors.selfcheck import warm_up
    from swarmroute.backends import build_backend

    model = BUILDERS["llama"](Dims(n_layers=4, n_nextn=0), "tiny-unproven").write(tmp_path / "m.gguf", quant="F16",
                                                                                 seed=1)
    # A table without llama, not llama deleted from the shared one (restoring it would reorder the table, whose order
    # docs/models/architectures.md follows).
    monkeypatch.setattr(arch_support, "SUPPORT", {k: v for k, v in SUPPORT.items() if k != "llama"})
    settings = Settings(home=tmp_path / "home")

    def node(*extra: str) -> argparse.Namespace:
        return build_parser().parse_args(["node", "--model", str(model), "--layers", "2:4", "--threads", "1",
                                          "--ctx", "256", "--max-sessions", "1", *extra])

    with pytest.raises(BadRequestError, match="'llama' is not proven") as refused:
        build_backend(node(), settings)
    assert "[2, 4)" in refused.value.message  # names the stored file it would cut, and the range
    backend, identity = build_backend(node(FLAG), settings)  # cut, verified, proven in a child
    try:
        assert (backend.layers.start, backend.layers.end) == (2, 4) and identity.verified
        warm_up(backend)  # and it computes, as a node has it do when it starts, before advertising
    finally:
        backend.close()


# --- a node's own override decides what it verifies, serves and repairs -------------------------------------------


def test_a_shard_someone_else_cut_verifies_only_under_the_nodes_own_override(stored: tuple[Path, ModelManifest]
                                                                            ) -> None:
    home, manifest = stored
    store = Store(home)
    shard = store.shard_path(manifest.model_id, 1, 3)
    refused = verify_shard(manifest, shard, 1, 3)
    assert not refused.ok
    ((kind, what, detail),) = [(p.kind, p.what, p.detail) for p in refused.problems]
    assert (kind, what) == ("metadata", "olmo") and "not proven" in detail
    assert verify_shard(manifest, shard, 1, 3, allow_unproven=True).ok
    assert (1, 3) not in {(a, b) for a, b, _ in verify_store(store, manifest.model_id).servable}
    assert (1, 3) in {(a, b) for a, b, _ in verify_store(store, manifest.model_id, allow_unproven=True).servable}
    # A node serving it: the store's shard is refused without the override, loaded with it.
    with pytest.raises(ArtifactError, match="not proven"):
        prepare(home, None, model_id=manifest.model_id, start=1, end=3)
    assert prepare(home, None, model_id=manifest.model_id, start=1, end=3, allow_unproven=True).path == shard


def _damage(path: Path) -> None:
    layout = read_layout(path)
    with path.open("r+b") as f:
        f.seek(layout.tensors[-1].offset)
        byte = f.read(1)
        f.seek(layout.tensors[-1].offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("allowed", [False, True], ids=["without the override", "with the override"])
async def test_seeding_repairs_and_announces_an_unproven_shard_only_under_the_override(
        stored: tuple[Path, ModelManifest], settings: Settings, nc: Any, allowed: bool) -> None:
    """``ArtifactSync.seed`` rewrites a damaged shard from verified data: for an unproven architecture only when the
    seeding node itself passed the override; otherwise the shard stays unverified and is never announced."""
    home, manifest = stored
    store = Store(home)
    shard = store.shard_path(manifest.model_id, 1, 3)
    _damage(shard)
    damaged = shard.read_bytes()
    session = TorrentSession()
    try:
        async with ArtifactSync(settings, store, session, SyncConfig(node_id="seed", allow_unproven=allowed),
                                nc=nc) as sync:
            report = await sync.seed(manifest.model_id)
            announced = {(r.start, r.end) for r in sync.me(manifest.model_id).ranges}
    finally:
        session.close()
    (verdict,) = report.shards
    assert verdict.ok is allowed
    assert ((1, 3) in announced) is allowed
    assert (0, 4) in announced  # the verified data itself is seeded either way (cutting it is each fetcher's call)
    if allowed:
        assert shard.read_bytes() != damaged and verify_shard(manifest, shard, 1, 3, allow_unproven=True).ok
    else:
        assert shard.read_bytes() == damaged  # not rewritten
        assert any(p.kind == "metadata" and "not proven" in p.detail for p in verdict.problems)
