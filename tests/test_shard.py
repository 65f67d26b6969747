"""Shard GGUFs: the right tensors, byte-for-byte, with layer-keyed metadata rewritten, and llama.cpp loads them.

llama.cpp is the judge: a subprocess (tests/support/llama_probe.py) loads each shard and reports its layer count,
vocabulary and, from llama.cpp's own load log, the per-layer sliding-window flags, which must equal the full model's
flags for the same global layers.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from artifacts.gguf_layout import read_layout, renumber
from artifacts.manifest import build_manifest
from artifacts.shard import (
    ShardSource,
    needed_byte_ranges,
    needed_tensors,
    plan_shard,
    write_shard,
)
from schemas.errors import BadRequestError
from tests.support.gguf_factory import write_tiny_gguf

REPO = Path(__file__).resolve().parents[1]


def probe(*paths: Path) -> list[dict[str, object]]:
    # As a module from the repository root: run as a script, tests/support would come first on the path and its
    # actors.py would shadow the actors package.
    out = subprocess.run([sys.executable, "-m", "tests.support.llama_probe", *map(str, paths)], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def reference_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (type, shape, sha256 of bytes) read with gguf's own GGUFReader, independent of our parser."""
    reader = GGUFReader(path)
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape), sha(t.data.tobytes())) for t in reader.tensors}


def shard_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    layout = read_layout(path)
    with path.open("rb") as f:
        out = {}
        for t in layout.tensors:
            f.seek(t.offset)
            out[t.name] = (t.ggml_type.name, t.shape, sha(f.read(t.size)))
    return out


# -- the plan, on a tiny untied llama with a shared rope_freqs tensor ------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", head_count_kv=[2, 2, 2, 2])


def test_plan_by_position(tiny: Path) -> None:
    tensors = read_layout(tiny).tensors
    head = plan_shard(tensors, 4, 0, 2)
    assert {"token_embd.weight", "rope_freqs.weight", "output_norm.weight"} <= set(head.copied)
    assert "output.weight" not in head.copied and not head.synthetic and head.keep_tokenizer
    assert sorted(n for n in head.copied if n.startswith("blk.")) == sorted(
        n for n in (t.name for t in tensors) if n.split(".")[1] in ("0", "1") and n.startswith("blk."))

    middle = plan_shard(tensors, 4, 1, 3)
    assert not middle.keep_tokenizer
    assert "token_embd.weight" not in middle.copied and "output.weight" not in middle.copied
    assert {"rope_freqs.weight", "output_norm.weight"} <= set(middle.copied)
    (embd,) = middle.synthetic
    assert embd.name == "token_embd.weight" and embd.shape == (64, 1)

    tail = plan_shard(tensors, 4, 2, 4)
    assert {"output.weight", "output_norm.weight", "rope_freqs.weight"} <= set(tail.copied) and tail.keep_tokenizer
    (full_embd,) = tail.synthetic  # untied: the loader wants token_embd, the tail never looks tokens up
    assert full_embd.shape == (64, 32)

    whole = plan_shard(tensors, 4, 0, 4)
    assert whole.copied == tuple(t.name for t in tensors) and not whole.synthetic


def test_tied_tail_copies_token_embd(tmp_path: Path) -> None:
    tensors = read_layout(write_tiny_gguf(tmp_path / "tied.gguf", tied=True)).tensors
    tail = plan_shard(tensors, 4, 3, 4)
    assert "token_embd.weight" in tail.copied and not tail.synthetic


@pytest.mark.parametrize(("start", "end"), [(0, 0), (2, 1), (-1, 2), (0, 5)])
def test_bad_ranges_rejected(tiny: Path, start: int, end: int) -> None:
    with pytest.raises(BadRequestError):
        plan_shard(read_layout(tiny).tensors, 4, start, end)


def test_needed_byte_ranges_cover_exactly_the_needed_tensors(tiny: Path) -> None:
    manifest = build_manifest(tiny)
    for start, end in [(0, 2), (1, 3), (2, 4), (0, 4)]:
        ranges = needed_byte_ranges(manifest, start, end)
        tensors = needed_tensors(manifest, start, end)
        covered = sum(hi - lo for lo, hi in ranges)
        assert all(lo < hi for lo, hi in ranges) and ranges == sorted(ranges)
        header = manifest.header_size if start == 0 or end == 4 else 0
        # merged ranges may only add the alignment padding between consecutive tensors
        assert sum(t.size for t in tensors) + header <= covered <= sum(t.size for t in tensors) + header + 32 * len(
            tensors)
        for t in tensors:
            assert any(lo <= t.offset and t.end <= hi for lo, hi in ranges)
        skipped = [t for t in manifest.tensors if t not in tensors]
        for t in skipped:
            assert not any(lo < t.end and t.offset < hi for lo, hi in ranges if t.size), t.name


def test_tiny_shards_load_in_llama_cpp_with_sliced_metadata(tiny: Path, tmp_path: Path) -> None:
    ref = reference_tensors(tiny)
    ranges = [(0, 2), (1, 3), (2, 4), (0, 4)]
    paths = [write_shard(tiny, tmp_path / f"s{a}-{b}.gguf", a, b) for a, b in ranges]
    for (a, b), path, info in zip(ranges, paths, probe(tiny, *paths)[1:], strict=True):
        assert info["n_layer"] == b - a
        assert info["n_vocab"] == (32 if a == 0 or b == 4 else 1)
        meta = info["metadata"]
        assert isinstance(meta, dict)
        assert (meta["swarmroute.layer_start"], meta["swarmroute.layer_end"]) == (str(a), str(b))
        assert meta["swarmroute.n_layers_total"] == "4"
        got = shard_tensors(path)
        for name, value in got.items():
            original = next((n for n in ref if renumber(n, a) == name and (not n.startswith("blk.") or
                                                                           a <= int(n.split(".")[1]) < b)), None)
            if name == "token_embd.weight" and a > 0 and (b < 4 or "output.weight" in ref):
                continue  # generated zeros, checked below
            assert original is not None, name
            assert value == ref[original], name
        head_count_kv = read_layout(path).value("llama.attention.head_count_kv")
        assert head_count_kv == [2] * (b - a)


def test_generated_token_embd_is_zero(tiny: Path, tmp_path: Path) -> None:
    path = write_shard(tiny, tmp_path / "mid.gguf", 1, 3)
    embd = next(t for t in read_layout(path).tensors if t.name == "token_embd.weight")
    with path.open("rb") as f:
        f.seek(embd.offset)
        assert f.read(embd.size) == bytes(embd.size)


def test_shard_from_partial_store_file_matches_shard_from_full_file(tiny: Path, tmp_path: Path) -> None:
    """A node holding only the needed bytes writes the same shard as one holding the whole file."""
    manifest = build_manifest(tiny)
    data = tiny.read_bytes()
    for start, end in [(1, 3), (2, 4)]:
        partial = bytearray(len(data))
        for lo, hi in needed_byte_ranges(manifest, start, end):
            partial[lo:hi] = data[lo:hi]
        part_path = tmp_path / f"partial-{start}.gguf"
        part_path.write_bytes(bytes(partial))
        from_full = write_shard(ShardSource.from_gguf(tiny, manifest_id=manifest.manifest_id),
                                tmp_path / f"full-{start}-{end}.gguf", start, end)
        from_part = write_shard(ShardSource.from_manifest(manifest, part_path), tmp_path / f"p-{start}-{end}.gguf",
                                start, end)
        assert from_full.read_bytes() == from_part.read_bytes()


# -- the real model ------------------------------------------------------------------------------------------------

SPLITS = {"2-way": [(0, 9), (9, 18)], "3-way": [(0, 6), (6, 12), (12, 18)], "unaligned": [(0, 4), (4, 11), (11, 18)]}


@pytest.mark.slow
def test_gemma_shards_load_in_llama_cpp(gemma_path: Path, tmp_path: Path) -> None:
    ref = reference_tensors(gemma_path)
    ranges = sorted({r for split in SPLITS.values() for r in split} | {(0, 18)})
    paths = {r: write_shard(gemma_path, tmp_path / f"shard-{r[0]}-{r[1]}.gguf", *r) for r in ranges}
    full, *infos = probe(gemma_path, *paths.values())
    full_swa = full["is_swa"]
    assert isinstance(full_swa, list) and len(full_swa) == 18 and any(full_swa) and not all(full_swa)
    for (a, b), info in zip(ranges, infos, strict=True):
        assert info["n_layer"] == b - a
        assert info["n_embd"] == full["n_embd"]
        assert info["n_vocab"] == (full["n_vocab"] if a == 0 or b == 18 else 1)
        # llama.cpp's own per-layer SWA decision must follow the global layer, not the renumbered one
        assert info["is_swa"] == full_swa[a:b], (a, b)
        meta = info["metadata"]
        assert isinstance(meta, dict)
        assert (meta["swarmroute.layer_start"], meta["swarmroute.layer_end"]) == (str(a), str(b))
        assert meta["gemma3.block_count"] == str(b - a)

    for (a, b), path in paths.items():
        got = shard_tensors(path)
        expected = {renumber(n, a): v for n, v in ref.items()
                    if not n.startswith("blk.") or a <= int(n.split(".")[1]) < b}
        if a > 0 and b < 18:  # middle: token_embd is a generated 1-row stand-in, never the real one
            real = expected.pop("token_embd.weight")
            assert got.pop("token_embd.weight")[1] == (real[1][0], 1)
        assert got == expected, (a, b)


def test_bulk_array_packing_writes_what_gguf_writes(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    from gguf import GGUFWriter

    import artifacts.shard as shard_module

    fast = write_shard(tiny, tmp_path / "fast.gguf", 0, 2).read_bytes()
    monkeypatch.setattr(shard_module, "_ArrayWriter", GGUFWriter)
    assert write_shard(tiny, tmp_path / "stock.gguf", 0, 2).read_bytes() == fast
