"""``swarmroute node --model-id SHA256`` with no ``--model``: a node that provisions itself from the swarm.

``actors.provisioning.provisioner`` learns the manifest, gets a range (tracker assignment or ``--layers``), fetches
and verifies
it; this module then loads the verified shard through the same path as a local file (``swarmroute.backends``: the
store's ``require_verified_shard``, the llama.cpp self-check in a child, the warm-up), starts the ``Node`` on the
same NATS connection and serves until SIGTERM / SIGINT, seeding what it holds all along.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.errors import SwarmrouteError
from schemas.settings import Settings
from swarmroute.backends import DEFAULT_SESSIONS
from swarmroute.foreground import BACKEND_CRASHED, drain_node, make_node, node_backend, node_id, start_node, stop_event
from swarmroute.launcher import slug
from swarmroute.seeder import torrent_host, upload_limit

if TYPE_CHECKING:
    from actors.backend import Backend
    from actors.node import Node

log = logging.getLogger("swarmroute")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def wants_swarm(args: argparse.Namespace) -> bool:
    """A GGUF node given a content id (64 hex digits, the model file's sha256) and no local file: fetch it. Any
    other ``--model-id`` stays what it always was, a name to advertise."""
    return (args.backend == "llamacpp" and not args.model and bool(args.model_id)
            and _SHA256.match(args.model_id) is not None)


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes the machine can give a new process now (MemAvailable), the default of ``--memory``."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    with contextlib.suppress(OSError, ValueError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _default_context() -> int:
    from actors.backends.llamacpp.config import LlamaCppConfig

    default = next(f.default for f in dataclasses.fields(LlamaCppConfig) if f.name == "n_ctx")
    assert isinstance(default, int)
    return default


def run_node(args: argparse.Namespace, settings: Settings, runner: Callable[[Awaitable[int]], int]) -> int:
    try:
        return runner(_serve(args, settings))
    except SwarmrouteError as exc:
        print(f"swarmroute node: {exc.message}", file=sys.stderr, flush=True)
        return 2


async def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from actors.provisioning.holder import torrent_config
    from actors.provisioning.provisioner import ProvisionConfig, Provisioner
    from artifacts.progress import ProgressPrinter
    from artifacts.torrent import TorrentSession
    from schemas.errors import FetchCancelled

    name = node_id(args)
    memory = args.memory or available_memory()
    context = args.ctx or _default_context()
    # It seeds what it holds from the first piece on, within the upload limit, below its decoding's CPU priority.
    session = TorrentSession(torrent_config(settings, torrent_host(args, settings), args.torrent_port,
                                            upload_limit(args, settings, serving=True)))
    config = ProvisionConfig(node_id=name, model_id=args.model_id, memory_bytes=memory,
                             manifest_id=args.manifest_id, layers=args.layers,
                             max_sessions=args.max_sessions or DEFAULT_SESSIONS,
                             context=context, allow_unproven=args.allow_unproven_architecture,
                             aliases=tuple(args.alias or ()))
    cancel = threading.Event()
    stop = stop_event(cancel.set)  # a fetch in its thread stops at its next poll (resume data saved)
    provisioner = Provisioner(config, settings, session)
    node: Node | None = None
    backend: Backend | None = None
    log.info("node %s joining the swarm of model %s with %.1f MiB for it; seeding from %s:%d", name,
             args.model_id[:12], memory / 2**20, *session.address)
    try:
        await provisioner.start()
        provisioning = asyncio.create_task(provisioner.provision(printer=ProgressPrinter(), cancel=cancel))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({provisioning, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not provisioning.done():
            provisioning.cancel()
            with contextlib.suppress(asyncio.CancelledError, FetchCancelled):
                await provisioning
            return 0
        stopping.cancel()
        try:
            got = provisioning.result()
        except FetchCancelled:
            return 0
        args.model, args.layers, args.model_id = got.manifest.model_id, (got.start, got.end), None
        # The operator's names, those the swarm serves the model under, and the name `up` gives it (its slug).
        args.alias = list(dict.fromkeys([*got.aliases, slug(got.manifest.name or got.manifest.architecture)]))
        # the shard is loaded exactly as a local file is: verified in the store, proven in a child first
        built = await asyncio.to_thread(node_backend, args, settings)
        if built is None:
            return BACKEND_CRASHED
        backend, identity = built
        if stop.is_set():
            return 0
        await provisioner.hand_over()
        node = make_node(args, settings, backend, identity, name=name, nc=provisioner.nc)
        await start_node(node)
        await stop.wait()
        await provisioner.release_lease()  # draining: the range is free for a replacement at once
        await drain_node(node, settings)
        return 0
    finally:
        if node is not None:
            await node.stop()
        await provisioner.stop()
        session.close()
        if backend is not None:
            backend.close()
