"""A torrent session seeding a stored model, for fetch tests on loopback."""

from __future__ import annotations

from artifacts.store import Store
from artifacts.torrent import TorrentSession
from schemas.manifest import ModelManifest
from tests.support.waiting import eventually_sync


def seed(session: TorrentSession, store: Store, manifest: ModelManifest, timeout_s: float = 60.0) -> None:
    """Have ``session`` seed ``manifest``'s files from ``store``; returns once it seeds (pumping its alerts)."""
    job = session.add(manifest, store.model_dir(manifest.model_id), [])
    eventually_sync(lambda: str(job.status().state) == "seeding", timeout=timeout_s, sleep=session.pump,
                    what=lambda: f"the seeder seeding (stuck in {job.status().state})")
