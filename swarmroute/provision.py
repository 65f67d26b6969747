"""``swarmroute node --model-id SHA256`` with no ``--model``: a node that provisions itself from the swarm.

``actors.provisioner`` learns the manifest, gets a range (tracker assignment or ``--layers``), fetches and verifies
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
import signal
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from schemas.errors import SwarmrouteError
from schemas.settings import Settings

log = logging.getLogger("swarmroute")
T = TypeVar("T")
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


def _torrent_host(args: argparse.Namespace, settings: Settings) -> str:
    """Where the node seeds: ``--torrent-host``, else its own listen address when that is loopback/private."""
    from artifacts.torrent import is_private_address

    if args.torrent_host:
        return str(args.torrent_host)
    host = args.host or settings.bind_host
    return host if is_private_address(host) else "127.0.0.1"


def run_node(args: argparse.Namespace, settings: Settings, runner: Callable[[Awaitable[int]], int]) -> int:
    try:
        return runner(_serve(args, settings))
    except SwarmrouteError as exc:
        print(f"swarmroute node: {exc.message}", file=sys.stderr, flush=True)
        return 2


async def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from actors.node import Node, NodeConfig
    from actors.provisioner import ProvisionConfig, Provisioner
    from actors.selfcheck import BackendCrashedError, warm_up
    from artifacts.progress import ProgressPrinter
    from artifacts.torrent import SwarmConfig, TorrentSession
    from schemas.errors import FetchCancelled
    from swarmroute.backends import build_backend

    node_id = args.node_id or f"node-{uuid.uuid4().hex[:8]}"
    memory = args.memory or available_memory()
    context = args.ctx or _default_context()
    session = TorrentSession(SwarmConfig(listen_host=_torrent_host(args, settings), listen_port=args.torrent_port))
    config = ProvisionConfig(node_id=node_id, model_id=args.model_id, memory_bytes=memory,
                             manifest_id=args.manifest_id, layers=args.layers, max_sessions=args.max_sessions,
                             context=context, allow_unproven=args.allow_unproven_architecture,
                             aliases=tuple(args.alias or ()))
    stop, cancel = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        cancel.set()  # a fetch in its thread stops at its next poll (resume data saved)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal)
    provisioner = Provisioner(config, settings, session)
    node: Node | None = None
    backend = None
    log.info("node %s joining the swarm of model %s with %.1f MiB for it; seeding from %s:%d", node_id,
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
        try:  # the shard is loaded exactly as a local file is: verified in the store, proven in a child first
            backend, identity = await asyncio.to_thread(build_backend, args, settings)
        except BackendCrashedError as exc:
            print(f"swarmroute node: {exc.message}", file=sys.stderr, flush=True)
            return 3
        await asyncio.to_thread(warm_up, backend)
        if stop.is_set():
            return 0
        await provisioner.hand_over()
        node = Node(NodeConfig(node_id=node_id, model_id=identity.model_id, host=args.host or settings.bind_host,
                               port=args.port, advertise_url=args.advertise_url, wire_dtype=args.wire_dtype,
                               manifest_id=identity.manifest_id, verified=identity.verified,
                               aliases=tuple(args.alias or ())), backend, settings, nc=provisioner.nc)
        await node.start()
        print(f"node {node_id} ready at {node.endpoint} serving {identity.model_id} layers {backend.layers}",
              flush=True)
        await stop.wait()
        await provisioner.release_lease()  # draining: the range is free for a replacement at once
        left = await node.drain(settings.drain_timeout_s)
        if left:
            log.warning("stopping with %d session(s) still open after %gs", left, settings.drain_timeout_s)
        return 0
    finally:
        if node is not None:
            await node.stop()
        await provisioner.stop()
        session.close()
        if backend is not None:
            backend.close()
