"""Asking the swarm for a model's manifest over NATS (``Subjects.artifact_manifest``), checked by content hash.

Used by a node learning what to fetch (``actors.provisioning.artifact_sync.ArtifactSync``) and by a tracker that needs
the
model's shape to assign layers. Any holder may answer; a reply is accepted only when its ``manifest_id`` is the
hash of its content, it describes the model asked for, and (when given) it is the pinned ``expect_id``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from artifacts.manifest import check_manifest
from bus.subjects import Subjects
from schemas.errors import ArtifactError, NotFoundError
from schemas.manifest import ModelManifest

log = logging.getLogger(__name__)


async def gather(nc: NATS, subject: str, wait_s: float) -> list[bytes]:
    """Publish an empty request on ``subject`` and collect every reply that arrives within ``wait_s``."""
    inbox = nc.new_inbox()
    replies: list[bytes] = []

    async def collect(msg: Msg) -> None:
        replies.append(msg.data)

    sub = await nc.subscribe(inbox, cb=collect)
    try:
        await nc.publish(subject, b"", reply=inbox)
        await asyncio.sleep(wait_s)
    finally:
        await sub.unsubscribe()
    return replies


async def request_manifest(nc: NATS, subjects: Subjects, model_id: str, *, expect_id: str | None = None,
                           timeout_s: float = 5.0, gather_s: float = 0.5) -> ModelManifest:
    """The manifest from any holder; replies that fail the checks are skipped (and logged). ``NotFoundError`` when
    no valid one arrived within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for data in await gather(nc, subjects.artifact_manifest(model_id), gather_s):
            if not data:  # NATS' "no responders" status: nobody holds the model (yet)
                continue
            try:
                manifest = ModelManifest.model_validate_json(zlib.decompress(data))
                check_manifest(manifest, expect_id=expect_id, where="manifest from a peer")
            except (ValueError, zlib.error, ArtifactError) as exc:
                log.warning("rejected a manifest for %s: %s", model_id[:16], exc)
                continue
            if manifest.model_id == model_id:
                return manifest
    pinned = f" with manifest id {expect_id[:16]}..." if expect_id else ""
    raise NotFoundError(f"no peer answered with a valid manifest{pinned} for model {model_id[:16]}...")
