"""Verification: a store proves what it can serve, and says exactly why it cannot serve the rest."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from artifacts.gguf_layout import read_layout
from artifacts.manifest import build_manifest
from artifacts.shard import ShardSource, write_shard
from artifacts.store import Store
from artifacts.verify import require_verified_shard, verify_shard, verify_store
from schemas.errors import ArtifactError
from swarmroute.cli import main as artifact_cli
from tests.support.gguf_factory import write_tiny_gguf


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.fixture
def store(tmp_path: Path) -> tuple[Store, str]:
    source = write_tiny_gguf(tmp_path / "src" / "tiny.gguf", n_layers=6)
    st = Store(tmp_path / "home")
    manifest = st.import_gguf(source)
    src = ShardSource.from_manifest(manifest, st.data_path(manifest))
    for a, b in [(0, 3), (3, 6)]:
        write_shard(src, st.shard_path(manifest.model_id, a, b), a, b)
    return st, manifest.model_id


def servable(st: Store, model_id: str) -> set[tuple[int, int]]:
    return {(a, b) for a, b, _ in verify_store(st, model_id).servable}


def test_clean_store_serves_its_shards_and_the_whole_file(store: tuple[Store, str]) -> None:
    st, mid = store
    report = verify_store(st, mid)
    assert all(v.ok for v in report.shards) and [(v.start, v.end) for v in report.shards] == [(0, 3), (3, 6)]
    assert servable(st, mid) == {(0, 3), (3, 6), (0, 6)}
    assert require_verified_shard(st, mid, 0, 3) == st.shard_path(mid, 0, 3)


def test_flipped_byte_in_data_names_the_tensor_and_splits_servable_ranges(store: tuple[Store, str]) -> None:
    st, mid = store
    manifest = st.load(mid)
    bad = manifest.tensor("blk.2.ffn_up.weight")
    flip_byte(st.data_path(manifest), bad.offset + 7)
    report = verify_store(st, mid)
    problem = report.data.tensors["blk.2.ffn_up.weight"]
    assert problem is not None and problem.kind == "hash_mismatch"
    assert [n for n, p in report.data.tensors.items() if p is not None] == ["blk.2.ffn_up.weight"]
    data_ranges = {(v.start, v.end) for v in report.data_ranges if v.ok}
    assert data_ranges == {(0, 2), (3, 6)}
    assert not any(a <= 2 < b for a, b, source in report.servable if source == "data")


def test_flipped_byte_in_shard_is_caught_and_never_verified(store: tuple[Store, str]) -> None:
    st, mid = store
    manifest = st.load(mid)
    shard = st.shard_path(mid, 3, 6)
    target = next(t for t in read_layout(shard).tensors if t.name == "blk.1.attn_q.weight")  # global layer 4
    flip_byte(shard, target.offset + 100)
    verdict = verify_shard(manifest, shard, 3, 6)
    assert not verdict.ok
    assert [(p.kind, p.what) for p in verdict.problems] == [("hash_mismatch", "blk.1.attn_q.weight")]
    with pytest.raises(ArtifactError, match="blk.1.attn_q.weight"):
        require_verified_shard(st, mid, 3, 6)
    assert (3, 6) not in {(v.start, v.end) for v in verify_store(st, mid).shards if v.ok}


def test_truncated_and_missing_data_are_told_apart(store: tuple[Store, str]) -> None:
    st, mid = store
    manifest = st.load(mid)
    data = st.data_path(manifest)
    zeroed = manifest.tensor("blk.1.attn_k.weight")
    piece = manifest.torrent.piece_size
    first, last = zeroed.offset // piece, (zeroed.end - 1) // piece
    with data.open("r+b") as f:  # what a never-downloaded piece looks like in libtorrent's sparse file
        f.seek(first * piece)
        f.write(bytes((last - first + 1) * piece))
    cut = manifest.tensor("blk.4.attn_norm.weight")
    with data.open("r+b") as f:
        f.truncate(cut.offset + 3)
    report = verify_store(st, mid)
    kinds = {n: p.kind for n, p in report.data.tensors.items() if p is not None}
    assert kinds["blk.1.attn_k.weight"] == "missing"
    assert kinds["blk.4.attn_norm.weight"] == "truncated"
    assert all(kinds[t.name] == "truncated" for t in manifest.tensors if t.offset > cut.offset)
    assert report.data.header is None
    # the shards are separate files: still fine
    assert {(v.start, v.end) for v in report.shards if v.ok} == {(0, 3), (3, 6)}


def test_shard_for_another_range_is_not_accepted(store: tuple[Store, str]) -> None:
    st, mid = store
    manifest = st.load(mid)
    wrong = st.shard_path(mid, 1, 4)
    shutil.copyfile(st.shard_path(mid, 0, 3), wrong)
    verdict = verify_shard(manifest, wrong, 1, 4)
    kinds = {p.kind for p in verdict.problems}
    assert "metadata" in kinds and not verdict.ok


def test_cli_verify_reports_reasons_and_exit_code(store: tuple[Store, str], capsys: pytest.CaptureFixture[str]
                                                  ) -> None:
    st, mid = store
    home = str(st.root.parent)
    assert artifact_cli(["artifact", "verify", mid[:10], "--home", home]) == 0
    assert "can serve: [0, 3), [0, 6), [3, 6)" in capsys.readouterr().out
    manifest = st.load(mid)
    flip_byte(st.data_path(manifest), manifest.tensor("blk.5.ffn_down.weight").offset)
    shard = st.shard_path(mid, 0, 3)
    last = max(read_layout(shard).tensors, key=lambda t: t.offset)
    flip_byte(shard, shard.stat().st_size - 1)
    assert artifact_cli(["artifact", "verify", "--home", home]) == 1
    out = capsys.readouterr().out
    assert "hash_mismatch: blk.5.ffn_down.weight" in out
    assert f"[0, 3) from shard: hash_mismatch: {last.name}" in out
    assert "can serve: [0, 5)" in out
    assert artifact_cli(["artifact", "verify", "--home", home, "--range", "3:6"]) == 1


@pytest.mark.slow
def test_bundled_gemma_store_via_cli(gemma_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = str(tmp_path / "home")
    source = tmp_path / "gemma.gguf"
    shutil.copyfile(gemma_path, source)  # the store copy gets corrupted below: never the shared cached model
    assert artifact_cli(["artifact", "build", str(source), "--home", home]) == 0
    manifest = build_manifest(source)
    capsys.readouterr()
    assert artifact_cli(["artifact", "shard", manifest.model_id[:12], "--range", "6:12", "--home", home]) == 0
    assert capsys.readouterr().out.strip() == "[6, 12) from shard: ok"
    st = Store(Path(home))
    flip_byte(st.data_path(manifest), manifest.tensor("blk.3.attn_q.weight").offset + 1000)
    assert artifact_cli(["artifact", "verify", "--home", home]) == 1
    out = capsys.readouterr().out
    assert "hash_mismatch: blk.3.attn_q.weight" in out
    assert "can serve: [0, 3), [4, 18), [6, 12)" in out
