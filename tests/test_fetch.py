"""Partial fetch over real libtorrent sessions on loopback: only the needed pieces, hash-proved, shard verified."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from artifacts.fetch import FetchOptions, fetch_range
from artifacts.shard import needed_byte_ranges
from artifacts.store import Store
from artifacts.torrent import SwarmConfig, TorrentSession, is_private_address
from artifacts.verify import check_data_file, verify_shard
from schemas.artifact import FetchProgress
from schemas.errors import BadRequestError
from tests.support.gguf_factory import write_tiny_gguf
from tests.support.seeding import seed


@pytest.fixture
def sessions() -> Iterator[tuple[TorrentSession, TorrentSession]]:
    a, b = TorrentSession(), TorrentSession()
    yield a, b
    a.close()
    b.close()


def test_only_loopback_and_private_peers() -> None:
    assert all(is_private_address(h) for h in ("127.0.0.1", "10.1.2.3", "192.168.0.7", "172.20.0.1", "::1"))
    assert not any(is_private_address(h) for h in ("8.8.8.8", "1.1.1.1", "172.32.0.1", "2001:db8::1", "example.com"))
    with pytest.raises(BadRequestError):
        SwarmConfig(listen_host="0.0.0.0")


def test_session_has_no_discovery(sessions: tuple[TorrentSession, TorrentSession], tmp_path: Path) -> None:
    settings = sessions[0]._session.get_settings()
    assert not any(settings[k] for k in ("enable_dht", "enable_lsd", "enable_upnp", "enable_natpmp"))
    assert sessions[0].address[0] == "127.0.0.1" and sessions[0].address[1] > 0
    manifest = Store(tmp_path).import_gguf(write_tiny_gguf(tmp_path / "t.gguf"), piece_size=16 << 10)
    job = sessions[0].add(manifest, tmp_path / "x", [])
    assert job.connect([("8.8.8.8", 6881), ("93.184.216.34", 80)]) == 0  # public addresses are never dialled
    assert not job.handle.trackers()


def test_tiny_partial_fetch(sessions: tuple[TorrentSession, TorrentSession], tmp_path: Path) -> None:
    seeder, leecher = sessions
    source = write_tiny_gguf(tmp_path / "src.gguf", n_layers=8, n_embd=128, n_ff=256)
    seed_store = Store(tmp_path / "seed")
    manifest = seed_store.import_gguf(source, piece_size=16 << 10)
    seed(seeder, seed_store, manifest)
    events: list[FetchProgress] = []
    store = Store(tmp_path / "leech")
    result = fetch_range(store, manifest, 3, 6, session=leecher, peers=lambda: [seeder.address],
                         progress=events.append, options=FetchOptions(timeout_s=60))
    assert verify_shard(manifest, result.shard, 3, 6).ok
    done = result.progress
    needed = sum(hi - lo for lo, hi in needed_byte_ranges(manifest, 3, 6))
    assert done.bytes_needed == needed and done.phase == "done"
    # at most the partial pieces at each end of each needed range come on top
    slack = 2 * manifest.torrent.piece_size * len(needed_byte_ranges(manifest, 3, 6))
    assert needed <= done.bytes_downloaded <= needed + slack
    assert done.bytes_downloaded < manifest.file_size / 2
    phases = [e.phase for e in events]
    assert phases.index("fetching") < phases.index("verifying") < phases.index("writing") < phases.index("done")
    assert [e.pieces_done for e in events] == sorted(e.pieces_done for e in events)
    # tensors outside the range were never downloaded
    report = check_data_file(manifest, store.data_path(manifest))
    assert report.tensors["blk.0.attn_q.weight"] is not None and report.tensors["blk.0.attn_q.weight"].kind == "missing"
    assert report.tensors["blk.4.attn_q.weight"] is None


def test_local_corruption_is_detected_and_fetched_again(sessions: tuple[TorrentSession, TorrentSession],
                                                        tmp_path: Path) -> None:
    seeder, leecher = sessions
    seed_store = Store(tmp_path / "seed")
    manifest = seed_store.import_gguf(write_tiny_gguf(tmp_path / "src.gguf", n_layers=6, n_embd=128),
                                      piece_size=16 << 10)
    seed(seeder, seed_store, manifest)
    store = Store(tmp_path / "leech")
    first = fetch_range(store, manifest, 2, 4, session=leecher, peers=lambda: [seeder.address])
    leecher.remove(first.job)
    first.shard.unlink()
    bad = manifest.tensor("blk.3.ffn_gate.weight")
    data = store.data_path(manifest)
    before = data.stat()
    with data.open("r+b") as f:
        f.seek(bad.offset + 5)
        f.write(b"\xff\xfe\xfd")
    # silent corruption (bit rot) leaves the mtime alone: libtorrent's resume data still claims the piece
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert check_data_file(manifest, store.data_path(manifest), only=[bad.name]).tensors[bad.name] is not None
    events: list[FetchProgress] = []
    second = fetch_range(store, manifest, 2, 4, session=leecher, peers=lambda: [seeder.address],
                         progress=events.append, options=FetchOptions(timeout_s=60))
    assert any("re-checking" in e.message and bad.name in e.message for e in events)
    assert verify_shard(manifest, second.shard, 2, 4).ok
    assert check_data_file(manifest, store.data_path(manifest), only=[bad.name]).tensors[bad.name] is None


@pytest.mark.slow
def test_gemma_middle_range_fetch(gemma_path: Path, tmp_path: Path,
                                  sessions: tuple[TorrentSession, TorrentSession]) -> None:
    seeder, leecher = sessions
    copy = tmp_path / "gemma.gguf"
    shutil.copyfile(gemma_path, copy)
    seed_store = Store(tmp_path / "seed")
    manifest = seed_store.import_gguf(copy)
    seed(seeder, seed_store, manifest)
    result = fetch_range(Store(tmp_path / "leech"), manifest, 6, 12, session=leecher, peers=lambda: [seeder.address])
    p = result.progress
    assert verify_shard(manifest, result.shard, 6, 12).ok
    assert p.bytes_needed <= p.bytes_downloaded <= p.bytes_needed + 4 * manifest.torrent.piece_size
    assert p.bytes_downloaded < 0.1 * manifest.file_size  # a middle range skips the 178 MB embedding
