"""A libtorrent session locked down for a private swarm, and the per-model torrent job it runs.

Peers are only ever the explicit addresses the control plane hands in (``connect``), and only loopback or private
ones: no trackers, no DHT, no local service discovery, no UPnP / NAT-PMP, private torrents (no peer exchange), and
an IP filter that blocks every other address as a second line of defence. One file per torrent: the model's GGUF.
Pieces that fail their SHA-1 are discarded and requested again by libtorrent; the peer that sent them is banned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import libtorrent as lt

from artifacts.manifest import torrent_bytes
from schemas.errors import ArtifactError, BadRequestError
from schemas.manifest import ModelManifest

log = logging.getLogger(__name__)
_ALLOWED_NETS = ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "::1/128", "fc00::/7", "fe80::/10")
_ALERTS = (lt.alert.category_t.error_notification | lt.alert.category_t.status_notification
           | lt.alert.category_t.storage_notification
           | lt.alert.category_t.peer_notification)  # peer_ban_alert: who sent pieces that failed their SHA-1


def is_private_address(host: str) -> bool:
    """Loopback or private (RFC 1918 / ULA / link-local): the only addresses this swarm talks to."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(net) for net in _ALLOWED_NETS)


def peer_address(host: str, port: int) -> str:
    """``HOST:PORT`` (``[HOST]:PORT`` for IPv6), as bans are reported and announced addresses are looked up."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass
class SwarmConfig:
    listen_host: str = "127.0.0.1"
    """Address the torrent listener binds to (loopback or private)."""

    listen_port: int = 0
    """0 picks a free port."""

    download_limit: int = 0
    """Bytes/s per torrent, 0 for none (tests throttle to interrupt a fetch midway)."""

    upload_limit: int = 0
    """Bytes/s per torrent, 0 for none."""

    nice: int = 0
    """Niceness of libtorrent's threads (0-19): a node that serves a model seeds at a lower CPU priority than its
    decoding, so the pieces it uploads take only the CPU its sessions leave (tests/bench/bench_seed_while_serving.py).
    """

    def __post_init__(self) -> None:
        if not is_private_address(self.listen_host):
            raise BadRequestError(f"torrent listen address {self.listen_host} is not loopback or private")
        if not 0 <= self.nice <= 19:
            raise BadRequestError(f"torrent thread niceness {self.nice} is not within 0-19")


def _ip_filter() -> lt.ip_filter:
    f = lt.ip_filter()
    f.add_rule("0.0.0.0", "255.255.255.255", 1)
    f.add_rule("::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 1)
    for net in map(ipaddress.ip_network, _ALLOWED_NETS):
        f.add_rule(str(net.network_address), str(net.broadcast_address), 0)
    return f


def wanted_pieces(manifest: ModelManifest, byte_ranges: Iterable[tuple[int, int]]) -> list[int]:
    """Indices of the pieces overlapping any of the half-open byte ranges."""
    size = manifest.torrent.piece_size
    pieces: set[int] = set()
    for lo, hi in byte_ranges:
        if hi > lo:
            pieces.update(range(lo // size, (hi - 1) // size + 1))
    return sorted(pieces)


@dataclasses.dataclass
class JobCounters:
    hash_failures: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    resume_data: bytes | None = None
    banned: list[str] = dataclasses.field(default_factory=list)
    """``HOST:PORT`` of peers libtorrent banned for sending pieces that failed their SHA-1, in ban order."""


class TorrentJob:
    """One model's torrent in the session: which pieces this node wants, and what it has so far."""

    def __init__(self, session: TorrentSession, manifest: ModelManifest, handle: lt.torrent_handle,
                 wanted: list[int]) -> None:
        self.session = session
        self.manifest = manifest
        self.handle = handle
        self.wanted = wanted
        self.counters = JobCounters()
        self._connected: dict[tuple[str, int], float] = {}
        self._resume_event = threading.Event()
        self._flushed = threading.Event()

    @property
    def info_hash(self) -> str:
        return self.manifest.torrent.info_hash

    def want(self, pieces: Iterable[int]) -> None:
        """Add pieces to fetch (priority 4); pieces already wanted or held are unaffected."""
        add = sorted(set(pieces) - set(self.wanted))
        if add:
            self.handle.prioritize_pieces([(p, 4) for p in add])
            self.wanted = sorted(set(self.wanted) | set(add))

    def connect(self, peers: Iterable[tuple[str, int]], *, retry_s: float = 3.0) -> int:
        """Dial peers not connected lately; non-private addresses and our own listener are skipped."""
        now, dialled = time.monotonic(), 0
        current = {(p.ip[0], p.ip[1]) for p in self.handle.get_peer_info()}
        for host, port in peers:
            key = (host, int(port))
            if not is_private_address(host) or key == self.session.address or key in current:
                continue
            if now - self._connected.get(key, -retry_s) >= retry_s:
                self.handle.connect_peer(key)
                self._connected[key] = now
                dialled += 1
        return dialled

    def have(self) -> list[bool]:
        return list(self.handle.status(lt.status_flags_t.query_pieces).pieces)

    def peer_pieces(self) -> list[bool]:
        """Pieces some connected peer says it has (the union of their bitfields); a seed has them all."""
        n = self.manifest.torrent.n_pieces
        union = [False] * n
        for peer in self.handle.get_peer_info():
            if peer.flags & lt.peer_info.seed:
                return [True] * n
            for i, held in enumerate(peer.pieces):
                if held and i < n:
                    union[i] = True
        return union

    def wanted_done(self) -> int:
        pieces = self.have()
        return sum(1 for p in self.wanted if p < len(pieces) and pieces[p])

    def status(self) -> lt.torrent_status:
        return self.handle.status()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every downloaded block is on disk: a piece counts as "had" once its hash passed, possibly
        before libtorrent's disk thread wrote it, and the verifier reads the file."""
        self._flushed.clear()
        self.handle.flush_cache()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._flushed.is_set():
            self.session.pump(0.05)
        return self._flushed.is_set()

    def recheck(self) -> None:
        """Re-hash every piece on disk (after a tensor failed its sha256) so bad pieces are fetched again."""
        self.handle.force_recheck()

    def save_resume(self, path: Path, timeout_s: float = 5.0) -> bool:
        """Write libtorrent's resume data (which pieces are on disk) so a restart skips re-hashing the file."""
        self._resume_event.clear()
        self.handle.save_resume_data(lt.torrent_handle.save_info_dict)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._resume_event.is_set():
            self.session.pump(0.05)
        data = self.counters.resume_data
        if not self._resume_event.is_set() or data is None:
            return False
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        return True


def _new_session(params: lt.session_params, nice: int) -> lt.session:
    """A libtorrent session whose threads run at niceness ``nice``. Linux keeps a niceness per thread and a new
    thread inherits its creator's: the session is built on a thread of our own that lowered its priority first, so
    libtorrent's network thread, and the disk and hashing threads it starts later, all run below the caller's."""
    if nice <= 0:
        return lt.session(params)
    made: list[lt.session] = []
    failed: list[BaseException] = []

    def build() -> None:
        try:
            with contextlib.suppress(OSError):  # no per-thread priority here: the session runs at the caller's
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            made.append(lt.session(params))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            failed.append(exc)

    builder = threading.Thread(target=build, name="torrent-session", daemon=True)
    builder.start()
    builder.join()
    if failed:
        raise failed[0]
    return made[0]


class TorrentSession:
    """One libtorrent session per process; thread-safe enough for one driver thread plus status readers."""

    def __init__(self, config: SwarmConfig | None = None) -> None:
        self.config = config or SwarmConfig()
        params = lt.session_params()
        params.settings = self._settings()  # type: ignore[assignment]  # the binding takes a plain dict
        self._session = _new_session(params, self.config.nice)
        self._session.set_ip_filter(_ip_filter())
        self._jobs: dict[str, TorrentJob] = {}
        self._lock = threading.RLock()
        self._wait_listening()

    def _settings(self) -> dict[str, object]:
        c = self.config
        host = f"[{c.listen_host}]" if ":" in c.listen_host else c.listen_host
        return {
            "listen_interfaces": f"{host}:{c.listen_port}", "outgoing_interfaces": "",
            "enable_dht": False, "enable_lsd": False, "enable_upnp": False, "enable_natpmp": False,
            "enable_outgoing_utp": False, "enable_incoming_utp": False,  # TCP is faster on loopback/LAN
            "allow_multiple_connections_per_ip": True,  # every peer of a one-host swarm is 127.0.0.1
            "announce_to_all_trackers": False, "alert_mask": int(_ALERTS), "user_agent": "swarmroute",
            "peer_fingerprint": lt.generate_fingerprint("SR", 0, 1, 0, 0),
        }

    def _wait_listening(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._session.listen_port():
                return
            time.sleep(0.02)
        raise ArtifactError(f"torrent session could not listen on {self.config.listen_host}")

    @property
    def address(self) -> tuple[str, int]:
        return (self.config.listen_host, int(self._session.listen_port()))

    def job(self, info_hash: str) -> TorrentJob | None:
        return self._jobs.get(info_hash)

    def add(self, manifest: ModelManifest, save_dir: Path, wanted: list[int], *, resume: bytes | None = None
            ) -> TorrentJob:
        """Add the model's torrent, fetching only ``wanted`` pieces. Without ``resume`` libtorrent hashes what is
        already on disk, so a restarted or re-verified node never serves a corrupt piece it did not check."""
        with self._lock:
            existing = self._jobs.get(manifest.torrent.info_hash)
            if existing is not None:
                existing.want(wanted)
                return existing
            atp = lt.read_resume_data(resume) if resume else lt.add_torrent_params()
            atp.ti = lt.torrent_info(torrent_bytes(manifest))
            if str(atp.ti.info_hashes().v1) != manifest.torrent.info_hash:
                raise ArtifactError("torrent rebuilt from the manifest has a different info-hash")
            atp.save_path = str(save_dir)
            atp.flags &= ~(lt.torrent_flags.auto_managed | lt.torrent_flags.paused)
            atp.flags |= lt.torrent_flags.disable_dht | lt.torrent_flags.disable_lsd | lt.torrent_flags.disable_pex
            prio = [0] * manifest.torrent.n_pieces
            for p in wanted:
                prio[p] = 4
            atp.piece_priorities = prio
            save_dir.mkdir(parents=True, exist_ok=True)
            handle = self._session.add_torrent(atp)
            if self.config.download_limit:
                handle.set_download_limit(self.config.download_limit)
            if self.config.upload_limit:
                handle.set_upload_limit(self.config.upload_limit)
            job = TorrentJob(self, manifest, handle, sorted(wanted))
            self._jobs[manifest.torrent.info_hash] = job
            return job

    def pump(self, wait_s: float = 0.0) -> None:
        """Drain alerts into the jobs' counters (hash failures, errors, resume data)."""
        with self._lock:
            if wait_s:
                self._session.wait_for_alert(int(wait_s * 1000))
            for alert in self._session.pop_alerts():
                self._route(alert)

    def _route(self, alert: lt.alert) -> None:
        handle = getattr(alert, "handle", None)
        if handle is None or not handle.is_valid():
            return
        job = self._jobs.get(str(handle.info_hashes().v1))
        if job is None:
            return
        if isinstance(alert, lt.hash_failed_alert):
            job.counters.hash_failures += 1
        elif isinstance(alert, lt.peer_ban_alert):
            name = peer_address(*alert.endpoint)
            if name not in job.counters.banned:
                job.counters.banned.append(name)
                log.warning("banned torrent peer %s: it sent pieces that failed their SHA-1", name)
        elif isinstance(alert, lt.save_resume_data_alert):
            job.counters.resume_data = lt.write_resume_data_buf(alert.params)
            job._resume_event.set()
        elif isinstance(alert, lt.cache_flushed_alert):
            job._flushed.set()
        elif isinstance(alert, lt.save_resume_data_failed_alert):
            job._resume_event.set()
        elif isinstance(alert, lt.torrent_error_alert | lt.file_error_alert):
            job.counters.errors.append(alert.message())

    def remove(self, job: TorrentJob) -> None:
        with self._lock:
            self._jobs.pop(job.info_hash, None)
            self._session.remove_torrent(job.handle)

    def close(self) -> None:
        with self._lock:
            for job in list(self._jobs.values()):
                self._session.remove_torrent(job.handle)
            self._jobs.clear()
            self._session.pause()
