"""What the commands that run an actor in this process share: the stop signals, and a node's start-up and drain.

``swarmroute tracker|gateway|node|seeder|artifact fetch|seed`` each run until SIGINT or SIGTERM (``stop_event``);
a node is started the same way whether its shard was a local file (``swarmroute.cli``) or fetched from the swarm
first (``swarmroute.provision``): its backend built and proven, its ready line, its drain on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from schemas.settings import Settings

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from actors.backend import Backend
    from actors.node import Node
    from swarmroute.backends import Identity

log = logging.getLogger("swarmroute")
BACKEND_CRASHED = 3
"""Exit status of a node whose backend crashed (or failed) its start-up decode in a child process."""


def stop_event(*also: Callable[[], None]) -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets on the running loop; ``also`` runs first (e.g. a fetch thread's
    cancel flag, which it polls: the loop's event cannot reach it)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        for call in also:
            call()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # a loop without signal handlers (not on Linux)
            loop.add_signal_handler(sig, on_signal)
    return stop


async def serve_until_signal(start: Callable[[], Awaitable[Any]], stop: Callable[[], Awaitable[None]]) -> None:
    """Start an actor, run until SIGINT/SIGTERM, stop it."""
    done = stop_event()
    await start()
    try:
        await done.wait()
    finally:
        await stop()


# ---- a node ----------------------------------------------------------------------------------------------------

def node_id(args: argparse.Namespace) -> str:
    return str(args.node_id or f"node-{uuid.uuid4().hex[:8]}")


def node_backend(args: argparse.Namespace, settings: Settings) -> tuple[Backend, Identity] | None:
    """The node's backend, built (a llama.cpp backend proven in a child first; the node warms it up on its
    engine's thread when it starts); None, said on stderr, if it crashed its proof (exit with
    ``BACKEND_CRASHED``)."""
    from actors.selfcheck import BackendCrashedError
    from swarmroute.backends import build_backend

    try:
        return build_backend(args, settings)
    except BackendCrashedError as exc:
        print(f"swarmroute node: {exc.message}", file=sys.stderr, flush=True)
        return None


def make_node(args: argparse.Namespace, settings: Settings, backend: Backend, identity: Identity, *, name: str,
              nc: NATS | None = None) -> Node:
    """The ``Node`` the command line describes, serving ``backend`` (on ``nc`` when given, e.g. the connection a
    provisioning node fetched over)."""
    from actors.node import Node, NodeConfig

    return Node(NodeConfig(node_id=name, model_id=identity.model_id, host=args.host or settings.bind_host,
                           port=args.port, advertise_url=args.advertise_url, wire_dtype=args.wire_dtype,
                           manifest_id=identity.manifest_id, verified=identity.verified,
                           aliases=(*identity.aliases, *(args.alias or ()))), backend, settings, nc=nc,
                draft=draft_backend(args, settings, backend))


def draft_backend(args: argparse.Namespace, settings: Settings, backend: Backend) -> Backend | None:
    """The draft model a head runs for speculative sessions (``--draft-model`` or ``SWARMROUTE_DRAFT_MODEL``, issue
    #20): a whole GGUF with the served model's vocabulary, on one thread."""
    path = getattr(args, "draft_model", None) or settings.draft_model
    if path is None or not backend.is_head:
        return None
    from actors.backends import load_backend

    # One thread: its engine's worker is a second thread starting llama.cpp passes in this process, and a second
    # OpenMP pool there would make both models' passes sleep at every barrier (actors/node/engine.py).
    draft = load_backend("llamacpp", model_path=path, max_sessions=backend.max_sessions, n_ctx=min(
        backend.info.context_length, 4096), threads=1, allow_amx=settings.llama_amx,
                         native_dir=settings.home / "native")
    if draft.info.n_vocab != backend.info.n_vocab:
        draft.close()
        raise SystemExit(f"swarmroute node: the draft model {path} has {draft.info.n_vocab} tokens, the served "
                         f"model {backend.info.n_vocab}: a draft model needs the same vocabulary")
    return draft


async def start_node(node: Node) -> None:
    """Start it and print the ready line (launchers and tests wait for it)."""
    await node.start()
    print(f"node {node.config.node_id} ready at {node.endpoint} serving {node.config.model_id} layers "
          f"{node.backend.layers}", flush=True)


async def drain_node(node: Node, settings: Settings) -> None:
    """SIGTERM drains: out of the registry at once, open sessions given ``drain_timeout_s`` to finish; the caller
    stops the node afterwards."""
    left = await node.drain(settings.drain_timeout_s)
    if left:
        log.warning("stopping with %d session(s) still open after %gs", left, settings.drain_timeout_s)
