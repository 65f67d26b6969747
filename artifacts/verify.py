"""Proof before service: what a store holds, checked against the manifest, and exactly why a range is not servable.

Two things can serve a layer range: a shard file (``shard-a-b.gguf``, what llama.cpp loads) and the torrent's data
file (from which a shard can be written). Both are checked tensor by tensor against the manifest's sha256s; a shard
also against its plan (tensor set, renumbering, provenance metadata, zeroed synthetic tensors). Nothing here trusts
file names, sizes or libtorrent's piece state alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from artifacts.arch_support import check_cut
from artifacts.gguf_layout import GGUFLayout, TensorLayout, read_layout, renumber
from artifacts.gguf_split import ConcatReader
from artifacts.layer_metadata import RangeSpec, shard_fields
from artifacts.manifest import data_files
from artifacts.shard import SyntheticTensor, kv_from_entry, manifest_cut_request, manifest_plan, needed_tensors
from artifacts.store import Store
from schemas.errors import ArtifactError, BadRequestError, SwarmrouteError
from schemas.manifest import ModelManifest, TensorEntry

_CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """``kind``: missing_file | truncated | missing | hash_mismatch | missing_tensor | unexpected_tensor |
    wrong_tensor | metadata. In the data file ``missing`` means the failing pieces under the tensor are all zero
    (never downloaded) and ``hash_mismatch`` that one of them holds wrong bytes (corrupt)."""

    kind: str
    what: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.what}" + (f" ({self.detail})" if self.detail else "")


@dataclasses.dataclass(frozen=True, slots=True)
class RangeVerdict:
    start: int
    end: int
    source: str
    """``shard`` (a shard file) or ``data`` (the torrent's data file)."""
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        head = f"[{self.start}, {self.end}) from {self.source}: "
        return head + ("ok" if self.ok else "; ".join(str(p) for p in self.problems))


@dataclasses.dataclass(frozen=True, slots=True)
class DataFileReport:
    """The torrent data file, tensor by tensor."""

    path: Path
    exists: bool
    size: int
    expected_size: int
    header: Problem | None
    tensors: dict[str, Problem | None]
    """tensor name -> None when it matches the manifest."""

    def tensor_ok(self, name: str) -> bool:
        return name in self.tensors and self.tensors[name] is None

    def problems_for(self, names: Iterable[str], *, header: bool) -> list[Problem]:
        if not self.exists:
            return [Problem("missing_file", self.path.name)]
        found = [p for n in names if (p := self.tensors.get(n, Problem("missing", n))) is not None]
        if header and self.header is not None:
            found.insert(0, self.header)
        return found


@dataclasses.dataclass(frozen=True, slots=True)
class StoreReport:
    manifest: ModelManifest
    data: DataFileReport
    shards: list[RangeVerdict]
    data_ranges: list[RangeVerdict]
    """The maximal runs of complete layers in the data file, each with its verdict as a servable range."""

    @property
    def servable(self) -> list[tuple[int, int, str]]:
        """(start, end, source) of every range this store can serve now."""
        out = [(v.start, v.end, v.source) for v in self.shards if v.ok]
        return out + [(v.start, v.end, v.source) for v in self.data_ranges if v.ok]


def _region_problem(f: object, name: str, offset: int, size: int, sha256: str) -> Problem | None:
    assert hasattr(f, "seek") and hasattr(f, "read")
    f.seek(offset)
    digest = hashlib.sha256()
    left, zero = size, True
    while left:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            return Problem("truncated", name, f"file ends {left} bytes before the end of it")
        digest.update(chunk)
        zero = zero and not any(chunk)
        left -= len(chunk)
    if digest.hexdigest() == sha256:
        return None
    if zero:
        return Problem("missing", name, "all zero bytes: not downloaded")
    return Problem("hash_mismatch", name, f"sha256 {digest.hexdigest()[:12]}... != manifest {sha256[:12]}...")


def _piece_problem(f: object, manifest: ModelManifest, name: str, offset: int, size: int) -> Problem:
    """Why a data-file region fails: look at the torrent pieces under it. All-zero failing pieces were never
    downloaded (``missing``); a failing piece with data in it is corrupt (``hash_mismatch``)."""
    assert hasattr(f, "seek") and hasattr(f, "read")
    piece = manifest.torrent.piece_size
    absent: list[int] = []
    corrupt: list[int] = []
    for i in range(offset // piece, (offset + size - 1) // piece + 1):
        f.seek(i * piece)
        data = f.read(min(piece, manifest.file_size - i * piece))
        if hashlib.sha1(data).hexdigest() == manifest.torrent.piece_sha1[i]:
            continue
        (absent if not any(data) else corrupt).append(i)
    if corrupt:
        return Problem("hash_mismatch", name, f"corrupt piece(s) {_pieces(corrupt)}")
    return Problem("missing", name, f"piece(s) {_pieces(absent)} not downloaded")


def _pieces(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:4]))
    return shown + (f" and {len(indices) - 4} more" if len(indices) > 4 else "")


def _data_problem(f: object, manifest: ModelManifest, name: str, offset: int, size: int, sha256: str
                  ) -> Problem | None:
    problem = _region_problem(f, name, offset, size, sha256)
    if problem is None or problem.kind == "truncated":
        return problem
    return _piece_problem(f, manifest, name, offset, size)


def _part_headers(f: ConcatReader, manifest: ModelManifest) -> Problem | None:
    """The headers of a split set's later parts (llama.cpp reads them when it loads the set whole). A header with
    data that does not match is a part of another set."""
    for part in manifest.parts[1:]:
        problem = _region_problem(f, f"header of {part.name}", part.offset, part.header_size, part.header_sha256)
        if problem is not None and problem.kind == "hash_mismatch":
            return Problem("hash_mismatch", part.name, "not this set's part: its header differs from the manifest's")
        if problem is not None:
            return problem
    return None


def check_data_file(manifest: ModelManifest, path: Path, only: Iterable[str] | None = None) -> DataFileReport:
    """Hash the header and every tensor (or only the named ones) of the torrent data file (for a split set: of
    the concatenation of its parts, ``path`` being the first; absent parts read as not downloaded)."""
    files = data_files(manifest, path)
    present = [p for p, _ in files if p.is_file()]
    if not present:
        return DataFileReport(path, False, 0, manifest.file_size, Problem("missing_file", path.name), {})
    wanted = set(only) if only is not None else None
    results: dict[str, Problem | None] = {}
    with ConcatReader(files) if manifest.parts else path.open("rb") as f:
        header = _data_problem(f, manifest, "header", 0, manifest.header_size, manifest.header_sha256)
        if header is None and isinstance(f, ConcatReader):
            header = _part_headers(f, manifest)
        for t in manifest.tensors:
            if wanted is None or t.name in wanted:
                results[t.name] = _data_problem(f, manifest, t.name, t.offset, t.size, t.sha256)
    size = sum(p.stat().st_size for p in present)
    return DataFileReport(path, True, size, manifest.file_size, header, results)


def data_range_verdict(manifest: ModelManifest, report: DataFileReport, start: int, end: int) -> RangeVerdict:
    plan = manifest_plan(manifest, start, end)
    names = [t.name for t in needed_tensors(manifest, start, end)]
    problems = report.problems_for(names, header=plan.keep_tokenizer)
    if report.exists and report.size < report.expected_size and not problems:
        problems = [Problem("truncated", report.path.name, f"{report.size} of {report.expected_size} bytes")]
    return RangeVerdict(start, end, "data", tuple(problems))


def _complete_runs(manifest: ModelManifest, report: DataFileReport) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    run_start: int | None = None
    for il, names in enumerate(manifest.groups.layers + [["<end>"]]):
        complete = il < manifest.n_layers and all(report.tensor_ok(n) for n in names)
        if complete and run_start is None:
            run_start = il
        elif not complete and run_start is not None:
            runs.append((run_start, il))
            run_start = None
    return runs


def _shard_tensor_problems(manifest: ModelManifest, path: Path, expected: list[TensorEntry | SyntheticTensor],
                           start: int, tensors: list[TensorLayout]) -> list[Problem]:
    by_name = {t.name: t for t in tensors}
    want = {renumber(t.name, start): t for t in expected}
    problems = [Problem("missing_tensor", n) for n in want if n not in by_name]
    problems += [Problem("unexpected_tensor", n) for n in by_name if n not in want]
    with path.open("rb") as f:
        for new_name, src in want.items():
            got = by_name.get(new_name)
            if got is None:
                continue
            type_name = src.ggml_type.name if isinstance(src, SyntheticTensor) else src.ggml_type
            if got.shape != tuple(src.shape) or got.ggml_type.name != type_name:
                problems.append(Problem("wrong_tensor", new_name, f"{got.ggml_type.name}{list(got.shape)}"))
                continue
            if isinstance(src, SyntheticTensor):
                problem = _zero_problem(f, new_name, got)
            else:
                problem = _region_problem(f, new_name, got.offset, got.size, src.sha256)
            if problem is not None:
                problems.append(problem)
    return problems


def _zero_problem(f: object, name: str, t: TensorLayout) -> Problem | None:
    assert hasattr(f, "seek") and hasattr(f, "read")
    f.seek(t.offset)
    left = t.size
    while left:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            return Problem("truncated", name)
        if any(chunk):
            return Problem("hash_mismatch", name, "generated tensor is not all zeros")
        left -= len(chunk)
    return None


def _plain(value: Any) -> Any:
    """Metadata values as comparable Python values (string arrays are bytes when read from a file)."""
    if isinstance(value, list):
        return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in value]
    return value


_WRITER_KEYS = ("general.architecture", "general.alignment")
"""Keys the GGUF writer sets itself."""


def _metadata_problems(manifest: ModelManifest, layout: GGUFLayout, start: int, end: int,
                       allow_unproven: bool) -> list[Problem]:
    """Every key the shard writer derives (layer count, per-layer arrays, sliding pattern, pins of the cut guard)
    must be what it would write today: a shard cut by an older writer, of an architecture now refused, or of an
    unproven one on a node that did not accept the risk (``allow_unproven``: the node's own override, not whoever
    cut the shard) is not served. The tokenizer is left to the tensor and header checks."""
    try:
        pins = check_cut(manifest_cut_request(manifest, start, end), allow_unproven=allow_unproven)
    except BadRequestError as exc:
        return [Problem("metadata", manifest.architecture, exc.message)]
    plan = manifest_plan(manifest, start, end)
    spec = RangeSpec(manifest.architecture, manifest.n_layers, start, end, plan.keep_tokenizer, manifest.manifest_id,
                     pins)
    expected = {kv.key: _plain(kv.value) for kv in shard_fields([kv_from_entry(e) for e in manifest.metadata], spec)
                if not kv.key.startswith("tokenizer.") and kv.key not in _WRITER_KEYS}
    got = {kv.key: _plain(kv.value) for kv in layout.fields
           if not kv.key.startswith("tokenizer.") and kv.key not in _WRITER_KEYS}
    problems = [Problem("metadata", k, f"{got.get(k)!r} != {v!r}") for k, v in expected.items() if got.get(k) != v]
    return problems + [Problem("metadata", k, "not written by this shard writer") for k in got if k not in expected]


def verify_shard(manifest: ModelManifest, path: Path, start: int, end: int, *,
                 allow_unproven: bool = False) -> RangeVerdict:
    """Check a shard file: provenance metadata, tensor set and every tensor's bytes against the manifest. A shard of
    an architecture the matrix has not proven verifies only with ``allow_unproven`` (the unproven-architecture
    override of the node that would serve or seed it)."""
    if not path.is_file():
        return RangeVerdict(start, end, "shard", (Problem("missing_file", path.name),))
    try:
        layout = read_layout(path)
    except SwarmrouteError as exc:
        return RangeVerdict(start, end, "shard", (Problem("truncated", path.name, exc.message),))
    meta = {"swarmroute.layer_start": start, "swarmroute.layer_end": end,
            "swarmroute.n_layers_total": manifest.n_layers, "swarmroute.manifest_id": manifest.manifest_id}
    problems = [Problem("metadata", k, f"{layout.value(k)!r} != {v!r}") for k, v in meta.items()
                if layout.value(k) != v]
    if not problems:
        problems = _metadata_problems(manifest, layout, start, end, allow_unproven)
    plan = manifest_plan(manifest, start, end)
    expected: list[TensorEntry | SyntheticTensor] = [manifest.tensor(n) for n in plan.copied]
    expected += list(plan.synthetic)
    problems += _shard_tensor_problems(manifest, path, expected, start, layout.tensors)
    return RangeVerdict(start, end, "shard", tuple(problems))


def _shard_ranges(store: Store, model_id: str) -> list[tuple[int, int]]:
    directory = store.model_dir(model_id)
    ranges = []
    for p in sorted(directory.glob("shard-*-*.gguf")) if directory.is_dir() else []:
        parts = p.stem.split("-")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            ranges.append((int(parts[1]), int(parts[2])))
    return sorted(ranges)


def verify_store(store: Store, model_id: str, *, allow_unproven: bool = False) -> StoreReport:
    """Everything the store holds for ``model_id``: each shard file and each maximal run of complete layers in
    the data file, with a verdict (ok, or the exact problems). ``allow_unproven``: as ``verify_shard``."""
    manifest = store.load(model_id)
    data = check_data_file(manifest, store.data_path(manifest))
    shards = [verify_shard(manifest, store.shard_path(model_id, a, b), a, b, allow_unproven=allow_unproven)
              for a, b in _shard_ranges(store, model_id)]
    runs = [data_range_verdict(manifest, data, a, b) for a, b in _complete_runs(manifest, data)]
    return StoreReport(manifest, data, shards, runs)


def require_verified_shard(store: Store, model_id: str, start: int, end: int, *,
                           allow_unproven: bool = False) -> Path:
    """The shard path for ``[start, end)`` if, and only if, it verifies; ``ArtifactError`` listing why not otherwise.
    A node calls this before it advertises or serves the range, with its own unproven-architecture override."""
    manifest = store.load(model_id)
    path = store.shard_path(model_id, start, end)
    verdict = verify_shard(manifest, path, start, end, allow_unproven=allow_unproven)
    if not verdict.ok:
        raise ArtifactError(f"shard {verdict.describe()}")
    return path
