"""``swarmroute seeder MODEL``: a machine that holds a model's GGUF and seeds it to the swarm, so nodes started with
only ``--model-id`` can fetch their layers from it. ``MODEL`` is a GGUF path (hard-linked into the store, no
second copy where the filesystem allows), ``bundled`` for the bundled Gemma 3 270M, or a model id already in the
store. It verifies what it holds, seeds exactly the verified ranges and answers manifest requests until SIGTERM;
it is a NATS micro service (role ``seeder``), so ``fleet status`` sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from schemas.errors import SwarmrouteError
from schemas.settings import Settings
from swarmroute import argtypes, artifact_commands
from swarmroute.foreground import stop_event

BUNDLED = "bundled"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("seeder", help="hold a model's GGUF and seed it to the swarm (nodes fetch their layers)")
    p.add_argument("model", nargs="?", help=f"GGUF path, '{BUNDLED}', or a model id (prefix) in the store")
    p.add_argument("--node-id", default=None, help="name in announcements (default: seeder-<host>)")
    p.add_argument("--listen-host", default=None, help="torrent listen address, loopback or private "
                                                       "(default: the bind host)")
    p.add_argument("--listen-port", type=argtypes.port, default=0, help="torrent listen port (0: any free port)")
    p.add_argument("--upload-limit", type=argtypes.at_least(0), default=0, help="bytes/s, 0 for unlimited")
    artifact_commands.add_unproven_option(p)  # shards in its store are verified (and repaired) under it
    return p


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
                                         listen_port=args.listen_port, upload_limit=args.upload_limit))
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

