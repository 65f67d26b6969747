"""``swarmroute``: run a whole swarm on one machine (``up``) or one actor against an existing NATS."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from schemas.settings import Settings
from swarmroute import argtypes, artifact_commands, eviction_command, fleet, plan_command, provision, seeder
from swarmroute.foreground import (
    BACKEND_CRASHED,
    drain_node,
    make_node,
    node_backend,
    node_id,
    serve_until_signal,
    start_node,
)

if TYPE_CHECKING:
    from actors.provisioning.holder import Holder

T = TypeVar("T")


def _settings(args: argparse.Namespace) -> Settings:
    fleet_settings: Settings | None = getattr(args, "fleet_settings", None)
    if fleet_settings is not None:  # a fleet member: everything came from the fleet file (swarmroute.fleet)
        return fleet_settings
    overrides: dict[str, Any] = {}
    for name in ("nats_url", "home", "namespace", "bind_host", "log_level"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _run(main: Awaitable[T]) -> T:
    """``asyncio.run`` on uvloop where it is installed: its loop costs about half of asyncio's per event, and every
    token crosses several event loops (node, gateway) on its way to the client."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)  # type: ignore[arg-type]
    return uvloop.run(main)  # type: ignore[arg-type]


# ---- actor commands ----------------------------------------------------------------------------------------------

def cmd_tracker(args: argparse.Namespace) -> int:
    from actors.tracker import Tracker

    tracker = Tracker(_settings(args))
    _run(serve_until_signal(tracker.start, tracker.stop))
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.app import Gateway

    settings = _settings(args)
    gateway = Gateway(settings, host=args.host, port=args.port)

    async def start() -> None:
        await gateway.start()
        print(f"gateway ready at {gateway.url}", flush=True)

    _run(serve_until_signal(start, gateway.stop))
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if provision.wants_swarm(args):  # --model-id SHA256 and no file: fetch its range from the swarm first
        return provision.run_node(args, settings, _run)
    built = node_backend(args, settings)
    if built is None:
        return BACKEND_CRASHED
    backend, identity = built
    node = make_node(args, settings, backend, identity, name=node_id(args))
    holders: list[Holder | None] = []

    async def start() -> None:
        await start_node(node)
        holders.append(await seeder.hold_served(args, settings, node))  # it seeds what it holds, in the background

    async def stop() -> None:
        await drain_node(node, settings)
        for holder in holders:
            if holder is not None:
                await holder.stop()
        await node.stop()

    try:
        _run(serve_until_signal(start, stop))
    finally:
        backend.close()
    return 0


def cmd_nats(args: argparse.Namespace) -> int:
    from bus.server import EmbeddedNats, NatsServerConfig

    settings = _settings(args)
    server = EmbeddedNats(NatsServerConfig(store_dir=args.store_dir or settings.home / "nats", host=args.host,
                                           port=args.port, config_file=args.config, server_name=args.server_name))
    server.start()
    print(f"nats ready at {server.url}", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from swarmroute.watch import watch

    return _run(watch(_settings(args), once=args.once, duration=args.duration))


def cmd_seeder(args: argparse.Namespace) -> int:
    return seeder.cmd_seeder(args, _settings(args))


def cmd_up(args: argparse.Namespace) -> int:
    from swarmroute.launcher import run_up

    return run_up(args, _settings(args))


# ---- parser ------------------------------------------------------------------------------------------------------

def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", dest="nats_url", help="NATS URL(s), comma-separated (env SWARMROUTE_NATS_URL)")
    p.add_argument("--home", type=Path, help="state directory (env SWARMROUTE_HOME)")
    p.add_argument("--namespace", help="subject namespace (env SWARMROUTE_NAMESPACE)")
    p.add_argument("--log-level", dest="log_level", help="debug, info, warning")


def _fleet_member(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", type=Path, help="fleet file: run the member --name of it (other options come from it)")
    p.add_argument("--name", help="with --fleet: this member's name in the fleet file")


def _backend_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["llamacpp", "stub", "torch"], default="llamacpp")
    p.add_argument("--model", help="GGUF path (llamacpp/torch; default: the bundled Gemma 3 270M) or stub model id")
    p.add_argument("--model-id", help="id to advertise (default: the model's name); for a GGUF node without "
                                      "--model, a model's sha256 (64 hex digits) makes the node fetch its layers "
                                      "from the swarm")
    p.add_argument("--max-sessions", type=argtypes.positive, default=None,
                   help="concurrent sessions (KV slots) on this node (default: a llama.cpp node with --memory takes "
                        "as many as that memory holds caches for at --ctx beside its layers; else 4)")
    p.add_argument("--ctx", type=argtypes.context, default=None, help="context per session in tokens (4096, 32K)")
    p.add_argument("--threads", type=argtypes.positive, default=None,
                   help="compute threads per node (default: every core; with up, each node gets an equal share "
                        "of this machine's cores, at least 1, e.g. 1 each for 2 nodes on 2 cores)")
    p.add_argument("--n-layers", type=argtypes.positive, default=8, help="stub: layers of the toy model")
    p.add_argument("--hidden-shape", type=argtypes.hidden_shape, default=(64,),
                   help="stub: per-position hidden shape, e.g. 64 or 4x64")
    p.add_argument("--stub-delay", type=argtypes.non_negative, default=0.0,
                   help="stub: artificial seconds of compute per step")
    p.add_argument("--wire-dtype", choices=["f32", "bf16", "f16"], default="f32",
                   help="activation dtype on the wire: f32 bit-exact, bf16 or f16 half the bytes")
    p.add_argument("--allow-unproven-architecture", action="store_true",
                   help="cut a GGUF whose architecture the shard matrix has not proven bit-exact "
                        "(docs/models/architectures.md); refused architectures stay refused")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmroute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run NATS, tracker, nodes and the gateway on this machine")
    _common(up)
    _backend_options(up)
    up.add_argument("--nodes", type=argtypes.positive, default=None, help="nodes to split the layers over (default 2)")
    up.add_argument("--host", default=None, help="gateway address (default 127.0.0.1)")
    up.add_argument("--port", type=argtypes.port, default=None,
                    help="gateway port (default 8000, env SWARMROUTE_GATEWAY_PORT)")
    up.add_argument("--from-swarm", action="store_true",
                    help="one seeder holds the GGUF; the nodes start empty with only the model's id, are assigned "
                         "their layers by the tracker and fetch just those from the swarm")
    up.add_argument("--node-memory", type=argtypes.size, default=None,
                    help="with --from-swarm: the --memory each node declares (default: what splits the model over "
                         "exactly --nodes nodes)")
    up.set_defaults(func=cmd_up)

    tracker = sub.add_parser("tracker", help="run a tracker against an existing NATS")
    _common(tracker)
    _fleet_member(tracker)
    tracker.set_defaults(func=cmd_tracker)

    node = sub.add_parser("node", help="run one node against an existing NATS")
    _common(node)
    _backend_options(node)
    node.add_argument("--layers", type=argtypes.layers_or_all, default=None,
                      help="START:END layer range, or all (default: all; joining from the swarm, the tracker "
                           "assigns a range unless --layers is given)")
    node.add_argument("--node-id")
    node.add_argument("--host", default=None)
    node.add_argument("--port", type=argtypes.port, default=0)
    node.add_argument("--advertise-url", help="URL peers use to reach this node, if not the listen address")
    node.add_argument("--alias", action="append", help="another name clients may request the model by (repeatable)")
    node.add_argument("--draft-model", type=Path, default=None,
                      help="head: a small GGUF with the model's vocabulary to draft tokens for speculative sessions "
                           "(with SWARMROUTE_SPECULATION=model on the gateway)")
    swarm = node.add_argument_group("the artifact swarm (a GGUF node seeds what it holds; with --model-id SHA256 "
                                    "and no --model it fetches its layers first)")
    swarm.add_argument("--memory", type=argtypes.size, default=None,
                       help="memory to give the model, weights + KV (e.g. 24GB, 512MiB): the tracker sizes the "
                            "assigned range by it (default: what the machine has available)")
    swarm.add_argument("--manifest-id", help="accept only the manifest with this id (pinning)")
    swarm.add_argument("--torrent-host", help="address to seed from (default: --host when private, else loopback)")
    swarm.add_argument("--torrent-port", type=argtypes.port, default=0, help="torrent listen port (0: any free)")
    seeder.add_upload_limit(swarm)
    _fleet_member(node)
    node.set_defaults(func=cmd_node)

    gateway = sub.add_parser("gateway", help="run the OpenAI gateway against an existing NATS")
    _common(gateway)
    gateway.add_argument("--host", default=None)
    gateway.add_argument("--port", type=argtypes.port, default=8000)
    _fleet_member(gateway)
    gateway.set_defaults(func=cmd_gateway)

    seed = seeder.add_parser(sub)
    _common(seed)
    _fleet_member(seed)
    seed.set_defaults(func=cmd_seeder)

    nats = sub.add_parser("nats", help="run the embedded NATS server (JetStream on)")
    _common(nats)
    nats.add_argument("--host", default="127.0.0.1")
    nats.add_argument("--port", type=argtypes.port, default=4222)
    nats.add_argument("--store-dir", type=Path)
    nats.add_argument("--config", type=Path, help="nats-server config file (clusters, auth)")
    nats.add_argument("--server-name")
    nats.set_defaults(func=cmd_nats)

    watch = sub.add_parser("watch", help="show nodes and live sessions from NATS")
    _common(watch)
    watch.add_argument("--once", action="store_true", help="print one snapshot and exit")
    watch.add_argument("--duration", type=argtypes.non_negative, default=None, help="stop after this many seconds")
    watch.set_defaults(func=cmd_watch)

    artifact_commands.register(sub)
    plan_command.register(sub)
    eviction_command.register(sub, _common, _settings)
    fleet.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "fleet", None) is not None:
        args = fleet.resolve_member(args, build_parser())
    _logging(getattr(args, "log_level", None) or "info")
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
