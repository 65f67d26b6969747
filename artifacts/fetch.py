"""Partial fetch: download only the pieces a layer range needs, prove them, and write the verified shard.

The caller plugs in the swarm through two callbacks, so this module knows nothing about NATS: ``peers()`` returns
the current torrent peer addresses (learned however), ``progress(p)`` receives ``FetchProgress`` snapshots.

Steps: pieces overlapping ``needed_byte_ranges`` get priority, all others none -> libtorrent fetches them from the
peers (SHA-1 per piece; a corrupt piece is dropped, refetched, and its sender banned) -> every needed tensor (and the
header when the shard keeps the tokenizer) is hashed against the manifest's sha256 -> if one fails, libtorrent
re-checks the file and fetches the bad pieces again -> the shard is written and verified as a whole.

Interruption: resume data is saved on a clean stop (and every few seconds). A restart trusts it only when the file
was not written after it; otherwise (a crash) libtorrent hashes the file and keeps every complete piece it finds,
so either way only the missing pieces are fetched again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from artifacts.arch_support import check_cut
from artifacts.availability import Unseeded, unseeded
from artifacts.shard import (
    ShardSource,
    manifest_cut_request,
    manifest_plan,
    needed_byte_ranges,
    needed_tensors,
    write_shard,
)
from artifacts.store import Store
from artifacts.torrent import TorrentJob, TorrentSession, wanted_pieces
from artifacts.verify import RangeVerdict, check_data_file, verify_shard
from schemas.artifact import FetchPhase, FetchProgress
from schemas.errors import ArtifactError, FetchCancelled
from schemas.manifest import ModelManifest
from schemas.node import LayerRange

PeerSource = Callable[[], Iterable[tuple[str, int]]]
ProgressSink = Callable[[FetchProgress], None]
PeerNames = Callable[[], Mapping[str, str]]
"""``HOST:PORT`` -> the node id that announced that torrent address (read on the fetch thread)."""


@dataclasses.dataclass
class FetchOptions:
    timeout_s: float = 600.0
    """Give up when the needed pieces are not all in by then."""

    poll_s: float = 0.25
    """How often peers are re-read and progress is reported."""

    resume_every_s: float = 2.0
    """How often resume data is saved while fetching (what an interruption can lose)."""

    max_repairs: int = 3
    """Re-checks allowed after a tensor fails its sha256 before giving up."""

    cancel: threading.Event | None = None
    """Set it to stop the fetch (resume data is saved first); ``fetch_range`` then raises ``FetchCancelled``."""

    allow_unproven: bool = False
    """Cut an architecture ``artifacts.arch_support`` has not proven (the user accepts the risk)."""

    peer_names: PeerNames | None = None
    """Who is behind an address: a banned peer is then reported as ``node-id (HOST:PORT)``, not by address only."""

    stall_s: float = 2.0
    """Without a new piece for this long, the fetch looks for needed pieces no connected peer has and reports
    them (``FetchProgress.unseeded_layers`` and its message) while it keeps waiting for a peer that has them."""


@dataclasses.dataclass
class FetchResult:
    shard: Path
    job: TorrentJob
    """Still in the session: the node keeps seeding the pieces it fetched."""
    progress: FetchProgress
    verdict: RangeVerdict
    """The shard's verification, passed (``fetch_range`` raises otherwise)."""


class _Reporter:
    def __init__(self, job: TorrentJob, manifest: ModelManifest, start: int, end: int, sink: ProgressSink | None,
                 node_id: str, peer_names: PeerNames | None = None) -> None:
        self.job, self.sink, self.node_id, self.peer_names = job, sink, node_id, peer_names
        self._banned: dict[str, str] = {}
        """Address -> how it is reported; fixed once named, so a peer that stops announcing keeps its name."""
        self.model_id, self.start, self.end = manifest.model_id, start, end
        self.needed = sum(hi - lo for lo, hi in needed_byte_ranges(manifest, start, end))
        size, n = manifest.torrent.piece_size, manifest.torrent.n_pieces
        self.wanted_bytes = sum(min(size, manifest.file_size - p * size) for p in job.wanted if p < n)
        self._carried = 0
        self._last = 0
        self.unseeded = Unseeded((), ())
        """Set while the fetch waits for pieces no connected peer has."""

    def downloaded(self, counter: int) -> int:
        # libtorrent restarts its payload counter when a torrent is re-checked: carry what came before.
        if counter < self._last:
            self._carried += self._last
        self._last = counter
        return self._carried + counter

    def banned(self) -> list[str]:
        """The banned peers in ban order, each as ``node-id (HOST:PORT)`` when an announcement names the address
        (a peer that dialled in from an ephemeral port, or a static ``--peer``, stays ``HOST:PORT``)."""
        names = self.peer_names() if self.peer_names is not None else {}
        for address in self.job.counters.banned:
            if address not in self._banned or (self._banned[address] == address and address in names):
                node = names.get(address)
                self._banned[address] = f"{node} ({address})" if node else address
        return [self._banned[a] for a in self.job.counters.banned]

    def snapshot(self, phase: FetchPhase, message: str = "") -> FetchProgress:
        st = self.job.status()
        done, wanted = self.job.wanted_done(), len(self.job.wanted)
        rate = float(st.download_payload_rate)
        left = self.wanted_bytes * (wanted - done) / wanted if wanted else 0
        waiting = self.unseeded and phase == "fetching"
        if waiting and not message:
            message = f"waiting for a peer that has {self.unseeded.describe()}: no connected peer seeds them"
        return FetchProgress(node_id=self.node_id, phase=phase, pieces_done=done, pieces_wanted=wanted,
                             bytes_downloaded=self.downloaded(int(st.total_payload_download)),
                             bytes_needed=self.needed, bytes_wanted=self.wanted_bytes,
                             rate_bps=rate, peers=int(st.num_peers),
                             hash_failures=self.job.counters.hash_failures, message=message,
                             model_id=self.model_id, start=self.start, end=self.end,
                             banned_peers=self.banned(),
                             unseeded_layers=[LayerRange(start=a, end=b) for a, b in self.unseeded.layers]
                             if waiting else [],
                             unseeded_parts=list(self.unseeded.parts) if waiting else [],
                             eta_s=left / rate if rate > 0 and not waiting else None)

    def report(self, phase: FetchPhase, message: str = "") -> FetchProgress:
        p = self.snapshot(phase, message)
        if self.sink is not None:
            self.sink(p)
        return p


def _unseeded(job: TorrentJob, rep: _Reporter) -> Unseeded:
    have, offered = job.have(), job.peer_pieces()
    missing = [p for p in job.wanted if p < len(have) and not have[p] and not offered[p]]
    return unseeded(job.manifest, rep.start, rep.end, missing)


def _wait_for_pieces(job: TorrentJob, rep: _Reporter, peers: PeerSource, resume: Path, opts: FetchOptions) -> None:
    deadline = time.monotonic() + opts.timeout_s
    next_resume = time.monotonic() + opts.resume_every_s
    last_done, last_new, last_look = -1, time.monotonic(), 0.0
    while True:
        job.session.pump(opts.poll_s)
        job.connect(peers())
        checking = str(job.status().state) in ("checking_files", "checking_resume_data")
        done = job.wanted_done()
        if done != last_done or checking:
            last_done, last_new = done, time.monotonic()
            rep.unseeded = Unseeded((), ())
        elif time.monotonic() - last_new >= opts.stall_s and time.monotonic() - last_look >= 1.0:
            # Stalled: say what nobody offers (a peer joining later clears it with its first piece).
            rep.unseeded, last_look = _unseeded(job, rep), time.monotonic()
        p = rep.report("checking" if checking else "fetching")
        if job.counters.errors:
            raise ArtifactError(f"torrent error: {job.counters.errors[-1]}")
        if not checking and p.pieces_done == p.pieces_wanted:
            return
        if opts.cancel is not None and opts.cancel.is_set():
            job.flush()
            job.save_resume(resume)
            raise FetchCancelled(f"fetch cancelled at {p.pieces_done}/{p.pieces_wanted} pieces")
        if time.monotonic() > deadline:
            nobody = f"; nobody seeds {rep.unseeded.describe()}" if rep.unseeded else ""
            raise ArtifactError(f"fetch timed out: {p.pieces_done}/{p.pieces_wanted} pieces from {p.peers} peers"
                                f"{nobody}")
        if time.monotonic() >= next_resume:
            job.save_resume(resume)
            next_resume = time.monotonic() + opts.resume_every_s


def _trusted_resume(resume: Path, data: list[Path]) -> bytes | None:
    """Resume data only if nothing was written to the files after it was saved (a clean stop). After a crash it is
    stale: libtorrent would re-download what arrived since; without it libtorrent hashes the files and finds every
    piece that is on disk."""
    if not resume.is_file():
        return None
    saved = resume.stat().st_mtime_ns
    if any(p.is_file() and p.stat().st_mtime_ns > saved for p in data):
        return None
    return resume.read_bytes()


def _tensor_problems(manifest: ModelManifest, data: Path, start: int, end: int) -> list[str]:
    plan = manifest_plan(manifest, start, end)
    report = check_data_file(manifest, data, only=[t.name for t in needed_tensors(manifest, start, end)])
    problems = [str(p) for p in report.tensors.values() if p is not None]
    if plan.keep_tokenizer and report.header is not None:
        problems.insert(0, str(report.header))
    return problems


def fetch_range(store: Store, manifest: ModelManifest, start: int, end: int, *, session: TorrentSession,
                peers: PeerSource, progress: ProgressSink | None = None, node_id: str = "",
                options: FetchOptions | None = None) -> FetchResult:
    """Fetch what ``[start, end)`` needs into ``store`` and return the verified shard (already there: no download)."""
    opts = options or FetchOptions()
    # Refused before a byte is downloaded: a range that cannot be served exactly is never fetched.
    check_cut(manifest_cut_request(manifest, start, end), allow_unproven=opts.allow_unproven)
    store.add_manifest(manifest)
    model_dir = store.model_dir(manifest.model_id)
    resume_path = store.resume_path(manifest.model_id)
    resume = _trusted_resume(resume_path, [p for p, _ in store.data_files(manifest)])
    pieces = wanted_pieces(manifest, needed_byte_ranges(manifest, start, end))
    job = session.add(manifest, model_dir, pieces, resume=resume)
    rep = _Reporter(job, manifest, start, end, progress, node_id, opts.peer_names)
    shard = store.shard_path(manifest.model_id, start, end)
    verdict = verify_shard(manifest, shard, start, end, allow_unproven=opts.allow_unproven)
    if verdict.ok:
        return FetchResult(shard, job, rep.report("done", "shard already verified"), verdict)
    data = store.data_path(manifest)
    for attempt in range(opts.max_repairs + 1):
        _wait_for_pieces(job, rep, peers, resume_path, opts)
        rep.report("verifying")
        if not job.flush():
            raise ArtifactError("libtorrent did not confirm its disk writes in time")
        problems = _tensor_problems(manifest, data, start, end)
        if not problems:
            break
        if attempt == opts.max_repairs:
            raise ArtifactError(f"data still fails verification after {attempt} repairs: {problems[:3]}")
        rep.report("checking", f"re-checking pieces: {problems[0]}")
        job.recheck()
    job.save_resume(resume_path)
    rep.report("writing")
    write_shard(ShardSource.from_manifest(manifest, data), shard, start, end, allow_unproven=opts.allow_unproven)
    verdict = verify_shard(manifest, shard, start, end, allow_unproven=opts.allow_unproven)
    if not verdict.ok:
        rep.report("failed", verdict.describe())
        raise ArtifactError(f"written shard does not verify: {verdict.describe()}")
    return FetchResult(shard, job, rep.report("done"), verdict)
