"""``swarmroute seeder MODEL``: a machine that holds a model's GGUF and seeds it to the swarm, so nodes started with
only ``--model-id`` can fetch their layers from it. ``MODEL`` is a GGUF path (hard-linked into the store, no
second copy where the filesystem allows), ``bundled`` for the bundled Gemma 3 270M, or a model id already in the
store. It verifies what it holds, seeds exactly the verified ranges and answers manifest requests until SIGTERM;
it is a NATS micro service (role ``seeder``), so ``fleet status`` sees it.

Every other holder seeds too: a node serving a GGUF from its store (``hold_served``, below) and a node that
fetched its range (``swarmroute.provision``), each within ``--upload-limit`` (else ``Settings.seed_upload_limit``;
a seeder's is ``Settings.seeder_upload_limit``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.errors import SwarmrouteError
from schemas.settings import Settings
from swarmroute import argtypes, artifact_commands
from swarmroute.foreground import stop_event

if TYPE_CHECKING:
    from actors.node import Node
    from actors.provisioning.holder import Holder

BUNDLED = "bundled"
log = logging.getLogger("swarmroute")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("seeder", help="hold a model's GGUF and seed it to the swarm (nodes fetch their layers)")
    p.add_argument("model", nargs="?", help=f"GGUF path, '{BUNDLED}', or a model id (prefix) in the store")
    p.add_argument("--node-id", default=None, help="name in announcements (default: seeder-<host>)")
    p.add_argument("--listen-host", default=None, help="torrent listen address, loopback or private "
                                                       "(default: the bind host)")
    p.add_argument("--listen-port", type=argtypes.port, default=0, help="torrent listen port (0: any free port)")
    add_upload_limit(p)
    artifact_commands.add_unproven_option(p)  # shards in its store are verified (and repaired) under it
    return p


def add_upload_limit(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--upload-limit", type=argtypes.at_least(0), default=None,
                   help="bytes/s this process seeds the model's pieces at most, 0 for unlimited (default: "
                        "SWARMROUTE_SEED_UPLOAD_LIMIT, 20 MB/s, for a serving node; SWARMROUTE_SEEDER_UPLOAD_LIMIT, "
                        "unlimited, for a seeder)")


def upload_limit(args: argparse.Namespace, settings: Settings, *, serving: bool) -> int:
    """``--upload-limit``, else the setting for what the process is: a serving node shares its CPU with decoding."""
    limit = getattr(args, "upload_limit", None)
    if limit is not None:
        return int(limit)
    return settings.seed_upload_limit if serving else settings.seeder_upload_limit


def torrent_host(args: argparse.Namespace, settings: Settings) -> str:
    """Where a node seeds: ``--torrent-host``, else its own listen address when that is loopback/private."""
    from artifacts.torrent import is_private_address

    if args.torrent_host:
        return str(args.torrent_host)
    host = args.host or settings.bind_host
    return host if is_private_address(host) else "127.0.0.1"


async def hold_served(args: argparse.Namespace, settings: Settings, node: Node) -> Holder | None:
    """A started node serving a GGUF artifact from its store answers manifest requests for the model and seeds its
    pieces (``actors.provisioning.holder``), on the node's connection. None for a backend without an artifact (stub,
    torch) or when the torrent session cannot start (said in the log: serving goes on)."""
    from actors.provisioning.holder import Holder, HolderConfig, torrent_config

    if not node.config.manifest_id:
        return None
    layers = node.backend.layers
    config = HolderConfig(node_id=node.config.node_id, model_id=node.config.model_id,
                          served=(layers.start, layers.end),
                          torrent=torrent_config(settings, torrent_host(args, settings), args.torrent_port,
                                                 upload_limit(args, settings, serving=True)),
                          allow_unproven=args.allow_unproven_architecture)
    holder = Holder(config, settings, nc=node.nc)
    try:
        return await holder.start()
    except (SwarmrouteError, OSError) as exc:
        log.warning("node %s does not seed model %s: %s", node.config.node_id, node.config.model_id[:12],
                    getattr(exc, "message", exc))
        await holder.stop()
        return None


def cmd_seeder(args: argparse.Namespace, settings: Settings) -> int:
    if not args.model:
        print("swarmroute seeder: give the model (a GGUF path, 'bundled' or a model id)", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_seed(args, settings))
    except SwarmrouteError as exc:
        print(f"swarmroute seeder: {exc.message}", file=sys.stderr, flush=True)
        return 2


def _model_id(model: str, settings: Settings) -> str:
    from artifacts.store import Store
    from swarmroute.artifact_prep import import_model
    from swarmroute.backends import default_model_path

    path = default_model_path(settings) if model == BUNDLED else Path(model)
    if path.is_file():
        return import_model(settings.home, path).model_id
    return Store(settings.home).resolve(model)


async def _seed(args: argparse.Namespace, settings: Settings) -> int:
    from actors.provisioning.artifact_sync import ArtifactSync, SyncConfig
    from artifacts.store import Store
    from artifacts.torrent import SwarmConfig, TorrentSession
    from bus.service import register

    model_id = await asyncio.to_thread(_model_id, args.model, settings)
    name = args.node_id or settings.member_name or f"seeder-{model_id[:8]}"
    session = TorrentSession(SwarmConfig(listen_host=args.listen_host or settings.bind_host,
                                         listen_port=args.listen_port,
                                         upload_limit=upload_limit(args, settings, serving=False)))
    stop = stop_event()
    sync = ArtifactSync(settings, Store(settings.home), session,
                        SyncConfig(node_id=name, allow_unproven=args.allow_unproven_architecture), name=name)
    try:
        await sync.start()
        report = await sync.seed(model_id)
        ranges = sorted({(a, b) for a, b, _ in report.servable})
        sync.service = await register(sync.nc, namespace=settings.namespace, role="seeder", member=name,
                                 description="swarmroute seeder: seeds a model artifact's verified ranges",
                                 extra={"model_id": model_id, "torrent": "{}:{}".format(*session.address)})
        print(json.dumps({"event": "seeding", "node_id": name, "model_id": model_id,
                          "address": list(session.address), "ranges": ranges}), flush=True)
        await stop.wait()
        return 0
    finally:
        await sync.stop()  # leaves discovery, then drains its connection
        session.close()

