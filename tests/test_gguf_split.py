"""Split GGUF sets (``artifacts.gguf_split``) through the artifact plane: reading and checking a set, the manifest
over the concatenation of its parts, the store, shards cut across parts, verification naming a substituted part, a
partial fetch over a real multi-file torrent, and llama.cpp running the set whole and as a chain of shards."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from artifacts.fetch import FetchOptions, fetch_range
from artifacts.gguf_layout import read_layout, read_part
from artifacts.gguf_split import ConcatReader, part_name, split_prefix
from artifacts.manifest import build_manifest, load_manifest, save_manifest, torrent_bytes
from artifacts.shard import write_shard
from artifacts.store import Store
from artifacts.synthetic import BUILDERS, Dims
from artifacts.torrent import TorrentSession
from artifacts.verify import check_data_file, verify_shard, verify_store
from schemas.errors import BadRequestError
from tests.support.seeding import seed

DIMS = Dims(n_layers=6, n_nextn=0)


def model(directory: Path, *, seed: int = 0, per_part: int = 0, n_layers: int = 6) -> Path:
    """The tiny qwen3 model, whole or as a split set of at most ``per_part`` tensors per file."""
    b = BUILDERS["qwen3"](Dims(n_layers=n_layers, n_nextn=0), "t-qwen3")
    return b.write(directory / "qwen3.gguf", seed=seed, split_max_tensors=per_part)


@pytest.fixture
def single(tmp_path: Path) -> Path:
    return model(tmp_path / "single")


@pytest.fixture
def split(tmp_path: Path) -> Path:
    first = model(tmp_path / "split", per_part=25)
    assert first.name == "qwen3-00001-of-00003.gguf"
    return first


def concat_sha256(first: Path) -> str:
    digest = hashlib.sha256()
    for path, _ in read_layout(first).data_files:
        digest.update(path.read_bytes())
    return digest.hexdigest()


# --- reading a set ----------------------------------------------------------------------------------------------------


def test_a_set_reads_as_the_model_it_splits(single: Path, split: Path) -> None:
    whole, parts = read_layout(single), read_layout(split)
    assert len(parts.parts) == 3 and [p.path.name for p in parts.parts] == [part_name("qwen3", i, 3) for i in (1, 2, 3)]
    assert [(t.name, t.shape, t.ggml_type) for t in parts.tensors] == [(t.name, t.shape, t.ggml_type)
                                                                       for t in whole.tensors]
    assert {kv.key: kv.value for kv in parts.fields} == {kv.key: kv.value for kv in whole.fields}  # split.* dropped
    assert parts.total_size == sum(p.stat().st_size for p, _ in parts.data_files)
    with ConcatReader(parts.data_files) as stream, single.open("rb") as f:
        for a, b in zip(parts.tensors, whole.tensors, strict=True):
            stream.seek(a.offset)
            f.seek(b.offset)
            assert stream.read(a.size) == f.read(b.size), a.name  # offsets index the concatenation
    assert split_prefix(split) == ("qwen3", 1, 3) and split_prefix(single) is None


def test_a_missing_part_is_named(split: Path) -> None:
    split.with_name(part_name("qwen3", 2, 3)).unlink()
    with pytest.raises(BadRequestError, match=r"incomplete: missing qwen3-00002-of-00003\.gguf"):
        read_layout(split)


def test_a_later_part_is_not_a_model(split: Path) -> None:
    with pytest.raises(BadRequestError, match="give the first part, qwen3-00001-of-00003.gguf"):
        read_layout(split.with_name(part_name("qwen3", 2, 3)))
    assert read_part(split.with_name(part_name("qwen3", 2, 3))).architecture == ""


def test_parts_of_another_set_are_refused(split: Path, tmp_path: Path) -> None:
    second = split.with_name(part_name("qwen3", 2, 3))
    # A set cut into a different number of parts.
    other = model(tmp_path / "four", per_part=20)
    assert other.name.endswith("-of-00004.gguf")
    shutil.copyfile(other.with_name(part_name("qwen3", 2, 4)), second)
    with pytest.raises(BadRequestError, match=r"qwen3-00002-of-00003\.gguf is not part 2.*set of 4 parts"):
        read_layout(split)
    # A set of three parts of a model with other tensors.
    longer = model(tmp_path / "longer", per_part=31, n_layers=8)
    assert longer.name.endswith("-of-00003.gguf")
    shutil.copyfile(longer.with_name(part_name("qwen3", 2, 3)), second)
    with pytest.raises(BadRequestError, match="not part 2 of this 3-part set.*tensors.*another set"):
        read_layout(split)


def test_a_truncated_part_is_named(split: Path) -> None:
    third = split.with_name(part_name("qwen3", 3, 3))
    data = third.read_bytes()
    third.write_bytes(data[: len(data) - 100])
    with pytest.raises(BadRequestError, match=r"qwen3-00003-of-00003\.gguf is truncated"):
        read_layout(split)


# --- manifest, store, shards, verification ----------------------------------------------------------------------------


def test_the_manifest_covers_the_concatenation(single: Path, split: Path, tmp_path: Path) -> None:
    m = build_manifest(split)
    assert m.model_id == m.file_sha256 == concat_sha256(split)
    assert [p.name for p in m.parts] == [part_name("model", i, 3) for i in (1, 2, 3)]
    assert [f.path for f in m.torrent.files] == [p.name for p in m.parts] and m.torrent.file_name == "model"
    assert sum(p.size for p in m.parts) == m.file_size
    assert [p.sha256 for p in m.parts] == [hashlib.sha256(p.read_bytes()).hexdigest()
                                           for p, _ in read_layout(split).data_files]
    assert load_manifest(save_manifest(m, tmp_path / "m.json")).manifest_id == m.manifest_id
    assert b"files" in torrent_bytes(m)
    one = build_manifest(single)
    assert "parts" not in json.loads(one.to_json()) and "files" not in json.loads(one.to_json())["torrent"]
    assert [t.sha256 for t in one.tensors] == [t.sha256 for t in m.tensors]  # same tensors, other layout


def test_shards_cut_across_parts_equal_shards_of_the_single_file(single: Path, split: Path, tmp_path: Path) -> None:
    for a, b in ((0, 2), (2, 5), (5, 6)):
        one = write_shard(single, tmp_path / f"one-{a}-{b}.gguf", a, b)
        many = write_shard(split, tmp_path / f"many-{a}-{b}.gguf", a, b)
        assert one.read_bytes() == many.read_bytes()


def test_the_store_holds_a_set_and_verification_names_a_substituted_part(split: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    manifest = store.import_gguf(split)
    assert store.data_path(manifest) == store.model_dir(manifest.model_id) / "model" / "model-00001-of-00003.gguf"
    assert all(p.is_file() for p, _ in store.data_files(manifest))
    assert verify_store(store, manifest.model_id).servable == [(0, 6, "data")]
    assert store.import_gguf(split).manifest_id == manifest.manifest_id  # again: nothing copied twice
    # A part of another set with an identical layout (same tensors, other weights) passes every structural check;
    # the manifest's hashes catch it.
    other = model(tmp_path / "other", seed=9, per_part=25)
    second = store.data_files(manifest)[1][0]
    shutil.copyfile(other.with_name(part_name("qwen3", 2, 3)), second)
    report = check_data_file(manifest, store.data_path(manifest))
    bad = [name for name, problem in report.tensors.items() if problem is not None]
    assert bad and all(problem.kind == "hash_mismatch" for problem in report.tensors.values() if problem)
    in_second = {t.name for t in manifest.tensors if manifest.parts[1].offset <= t.offset < manifest.parts[1].end}
    assert set(bad) == in_second
    shard = write_shard(split, tmp_path / "s.gguf", 0, 2)
    assert shard.exists()


# --- a partial fetch over a multi-file torrent ------------------------------------------------------------------------


@pytest.fixture
def sessions() -> Iterator[tuple[TorrentSession, TorrentSession]]:
    a, b = TorrentSession(), TorrentSession()
    yield a, b
    a.close()
    b.close()


def test_a_middle_range_of_a_set_is_fetched_and_verified(split: Path, tmp_path: Path,
                                                         sessions: tuple[TorrentSession, TorrentSession]) -> None:
    seeder, leecher = sessions
    seed_store = Store(tmp_path / "seed")
    manifest = seed_store.import_gguf(split, piece_size=16 << 10)
    seed(seeder, seed_store, manifest)
    store = Store(tmp_path / "leech")
    result = fetch_range(store, manifest, 2, 4, session=leecher, peers=lambda: [seeder.address],
                         options=FetchOptions(timeout_s=60))
    assert verify_shard(manifest, result.shard, 2, 4).ok
    assert result.progress.bytes_downloaded < manifest.file_size
    report = check_data_file(manifest, store.data_path(manifest))
    assert report.tensors["blk.0.attn_q.weight"] is not None and report.tensors["blk.0.attn_q.weight"].kind == "missing"
    assert report.tensors["blk.3.attn_q.weight"] is None


# --- llama.cpp --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_llama_cpp_runs_the_set_whole_and_as_a_chain(split: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")  # a skip fails under CI=true (tests/support/ci_strict.py)
    from tests.support.arch_matrix import greedy, open_backend, open_chain, prompt_tokens

    whole = open_backend(split, tmp_path / "shards")
    try:
        assert whole.info.artifact_sha256 == concat_sha256(split)
        tokens = prompt_tokens(whole)
        reference = greedy([whole], tokens)
    finally:
        whole.close()
    hops = open_chain(split, tmp_path / "shards", (0, 2, 5, 6))
    try:
        chain = greedy(hops, tokens)
    finally:
        for h in hops:
            h.close()
    assert chain.picks == reference.picks and reference.max_diff(chain) == 0.0
