"""``swarmroute artifact build|verify|shard|fetch|seed|synthetic``: the model artifact commands. The work is done
by ``artifacts`` (manifests, shards, verification, synthetic models) and ``actors.provisioning.artifact_sync`` (the
swarm on NATS); this module only reads command lines and prints."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.errors import ArtifactError, FetchCancelled, SwarmrouteError
from schemas.settings import Settings
from swarmroute import argtypes
from swarmroute.foreground import stop_event

if TYPE_CHECKING:
    from actors.provisioning.artifact_sync import ArtifactSync
    from artifacts.store import Store
    from artifacts.verify import StoreReport

# The artifact modules need the gguf extra (gguf, libtorrent): imported by the commands that use them, so that the
# rest of the CLI works on an install without it.

BUNDLED = "bundled"


def home_of(args: argparse.Namespace) -> Path:
    return Path(args.home) if args.home else Settings().home


def _store(args: argparse.Namespace) -> Store:
    from artifacts.store import Store

    return Store(home_of(args))


def model_source(args: argparse.Namespace) -> Path:
    from artifacts.bundled import bundled_model_path

    return bundled_model_path(home_of(args)) if args.model == BUNDLED else Path(args.model)


def _cmd_build(args: argparse.Namespace) -> int:
    from artifacts.manifest import build_manifest, save_manifest

    source = model_source(args)
    started = time.perf_counter()
    if args.no_import:
        manifest = build_manifest(source, piece_size=args.piece_size)
    else:
        manifest = _store(args).import_gguf(source, link=args.link, piece_size=args.piece_size)
    elapsed = time.perf_counter() - started
    if args.out:
        save_manifest(manifest, Path(args.out))
    print(json.dumps({"model_id": manifest.model_id, "manifest_id": manifest.manifest_id, "name": manifest.name,
                      "architecture": manifest.architecture, "n_layers": manifest.n_layers,
                      "file_size": manifest.file_size, "tensors": len(manifest.tensors),
                      "piece_size": manifest.torrent.piece_size, "pieces": manifest.torrent.n_pieces,
                      "info_hash": manifest.torrent.info_hash, "seconds": round(elapsed, 3)}))
    return 0


def _report_lines(report: StoreReport) -> list[str]:
    m, d = report.manifest, report.data
    lines = [f"model {m.model_id} ({m.name or m.architecture}, {m.n_layers} layers) manifest {m.manifest_id[:16]}"]
    if not d.exists:
        lines.append(f"  data file {d.path.name}: absent")
    else:
        bad = [p for p in d.tensors.values() if p is not None]
        held = sum(1 for p in d.tensors.values() if p is None)
        lines.append(f"  data file {d.path.name}: {d.size} of {d.expected_size} bytes, {held}/{len(d.tensors)} "
                     f"tensors verified, header {'ok' if d.header is None else d.header}")
        lines += [f"    {p}" for p in bad if p.kind != "missing"]
        missing = [p.what for p in bad if p.kind == "missing"]
        if missing:
            lines.append(f"    missing (not downloaded): {len(missing)} tensors, e.g. {', '.join(missing[:3])}")
    lines += [f"  {v.describe()}" for v in report.shards + report.data_ranges]
    servable = sorted({(a, b) for a, b, _ in report.servable})
    lines.append("  can serve: " + (", ".join(f"[{a}, {b})" for a, b in servable) or "nothing"))
    return lines


def _report_json(report: StoreReport) -> dict[str, object]:
    d = report.data
    return {
        "model_id": report.manifest.model_id, "manifest_id": report.manifest.manifest_id,
        "data": {"exists": d.exists, "size": d.size, "expected_size": d.expected_size,
                 "header": None if d.header is None else str(d.header),
                 "problems": {n: str(p) for n, p in d.tensors.items() if p is not None}},
        "ranges": [{"start": v.start, "end": v.end, "source": v.source, "ok": v.ok,
                    "problems": [str(p) for p in v.problems]} for v in report.shards + report.data_ranges],
        "servable": [[a, b] for a, b in sorted({(a, b) for a, b, _ in report.servable})],
    }


def _cmd_verify(args: argparse.Namespace) -> int:
    from artifacts.verify import verify_store

    store = _store(args)
    ids = [store.resolve(args.model_id)] if args.model_id else store.model_ids()
    if not ids:
        print(f"no model artifacts in {store.root}", file=sys.stderr)
        return 1
    failed = False
    for model_id in ids:
        report = verify_store(store, model_id, allow_unproven=args.allow_unproven_architecture)
        bad_shards = [v for v in report.shards if not v.ok]
        bad_data = [p for p in report.data.tensors.values() if p is not None and p.kind != "missing"]
        failed = failed or bool(bad_shards or bad_data)
        if args.range is not None:
            a, b = args.range
            servable = {(x, y) for x, y, _ in report.servable}
            failed = failed or (a, b) not in servable
        print(json.dumps(_report_json(report)) if args.json else "\n".join(_report_lines(report)))
    return 1 if failed else 0


def _cmd_shard(args: argparse.Namespace) -> int:
    from artifacts.shard import ShardSource, write_shard
    from artifacts.verify import verify_shard

    a, b = args.range
    if args.source:
        out = Path(args.out or f"shard-{a}-{b}.gguf")
        write_shard(Path(args.source), out, a, b, allow_unproven=args.allow_unproven_architecture)
        print(out)
        return 0
    store = _store(args)
    manifest = store.load(store.resolve(args.model_id))
    out = Path(args.out) if args.out else store.shard_path(manifest.model_id, a, b)
    write_shard(ShardSource.from_manifest(manifest, store.data_path(manifest)), out, a, b,
                allow_unproven=args.allow_unproven_architecture)
    verdict = verify_shard(manifest, out, a, b, allow_unproven=args.allow_unproven_architecture)
    print(verdict.describe())
    return 0 if verdict.ok else 1


def _cmd_synthetic(args: argparse.Namespace) -> int:
    from artifacts.synthetic.matrix import synthetic_model

    out = Path(args.out)
    builder, quant = synthetic_model(args.arch, width=args.width, quant=args.quant)
    path = builder.write(out, quant=quant, seed=args.seed)
    print(f"{path}  {builder.arch} {builder.name} ({quant}, seed {args.seed}, {path.stat().st_size:,} bytes)")
    return 0


def guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command function that reports a SwarmrouteError as one line on stderr and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(handler(args))
        except SwarmrouteError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 2

    return run


def _settings(args: argparse.Namespace) -> Settings:
    settings = Settings()
    updates: dict[str, object] = {}
    if args.nats_url:
        updates["nats_url"] = args.nats_url
    if args.home:
        updates["home"] = Path(args.home)
    return settings.model_copy(update=updates)


async def _serve_forever(stop: asyncio.Event) -> None:
    await stop.wait()


async def _run(args: argparse.Namespace) -> int:
    from actors.provisioning.artifact_sync import ArtifactSync, SyncConfig
    from artifacts.torrent import SwarmConfig, TorrentSession

    settings = _settings(args)
    session = TorrentSession(SwarmConfig(listen_host=args.listen_host, listen_port=args.listen_port,
                                         download_limit=args.download_limit, upload_limit=args.upload_limit))
    sync = ArtifactSync(settings, _store(args), session,
                        SyncConfig(node_id=args.node_id, allow_unproven=args.allow_unproven_architecture))
    try:
        # the connection retries forever by design (survives NATS restarts): bound only the first attempt
        await asyncio.wait_for(sync.start(), args.connect_timeout)
    except (TimeoutError, OSError) as exc:
        session.close()
        raise ArtifactError(f"cannot reach NATS at {settings.nats_url}: {type(exc).__name__}") from exc
    cancel = threading.Event()
    stop = stop_event(cancel.set)
    try:
        return await _command(sync, args, stop, cancel)
    finally:
        await sync.stop()  # and drains its connection
        session.close()


async def _command(sync: ArtifactSync, args: argparse.Namespace, stop: asyncio.Event, cancel: threading.Event) -> int:
    from artifacts.fetch import FetchOptions
    from artifacts.progress import ProgressPrinter

    if args.artifact_command == "seed":
        model_id = sync.store.resolve(args.model_id)
        report = await sync.seed(model_id)
        ranges = sorted({(a, b) for a, b, _ in report.servable})
        print(json.dumps({"event": "seeding", "node_id": args.node_id, "address": list(sync.session.address),
                          "ranges": ranges}), flush=True)
        await _serve_forever(stop)
        return 0
    manifest = await sync.manifest_for(args.model_id, manifest_file=Path(args.manifest) if args.manifest else None,
                                       expect_id=args.manifest_id)
    await sync.hold(manifest, static_peers=args.peer or [])
    start, end = args.range if args.range else (0, manifest.n_layers)
    printer = None if args.quiet else ProgressPrinter()
    options = FetchOptions(timeout_s=args.timeout, cancel=cancel, allow_unproven=args.allow_unproven_architecture)
    try:
        result = await sync.fetch(manifest, start, end, printer=printer, options=options)
    except FetchCancelled as exc:
        print(json.dumps({"event": "cancelled", "message": exc.message}), flush=True)
        return 3
    print(json.dumps({"event": "fetched", "shard": str(result.shard), **result.progress.model_dump(mode="json")}),
          flush=True)
    if args.seed_after:
        await _serve_forever(stop)
    return 0


def add_unproven_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-unproven-architecture", action="store_true",
                   help="cut, verify and serve or seed shards of a GGUF whose architecture the shard matrix has not "
                        "proven bit-exact (docs/models/architectures.md); refused architectures stay refused")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``artifact build|verify|shard|fetch|seed`` to the top-level ``subparsers``; each command sets
    ``func(args) -> int``."""
    group = subparsers.add_parser("artifact", help="model artifacts: manifests, shards, verification, swarm")
    commands = group.add_subparsers(dest="artifact_command", required=True)

    build = commands.add_parser("build", help="write the manifest of a GGUF and add it to the store")
    build.add_argument("model", help=f"path of a GGUF file, or '{BUNDLED}' for the bundled Gemma 3 270M")
    build.add_argument("--out", help="also write the manifest JSON here")
    build.add_argument("--piece-size", type=argtypes.piece_size, default=None,
                       help="torrent piece size: a power of two >= 16 KiB, in bytes or with a unit (256KiB, 1MiB)")
    build.add_argument("--link", action="store_true", help="hard-link the file into the store instead of copying")
    build.add_argument("--no-import", action="store_true", help="only build the manifest, leave the store alone")
    build.set_defaults(func=guarded(_cmd_build))

    verify = commands.add_parser("verify", help="check what the store holds; print what it can serve and why not")
    verify.add_argument("model_id", nargs="?", help="model id (or unique prefix); default: every model")
    verify.add_argument("--range", type=argtypes.layer_range,
                        help="exit 1 unless this layer range START:END is servable")
    verify.add_argument("--json", action="store_true", help="machine-readable report")
    verify.set_defaults(func=guarded(_cmd_verify))

    shard = commands.add_parser("shard", help="write (and verify) the shard GGUF of a layer range")
    shard.add_argument("model_id", nargs="?", help="model id (or prefix) in the store")
    shard.add_argument("--range", type=argtypes.layer_range, required=True, help="layers START:END")
    shard.add_argument("--source", help="write from this complete GGUF instead of the store")
    shard.add_argument("--out", help="output path (default: the store's shard path)")
    shard.set_defaults(func=guarded(_cmd_shard))

    fetch = commands.add_parser("fetch", help="fetch the pieces a layer range needs from the swarm; write its shard")
    fetch.add_argument("--model-id", help="model id (sha256 of the GGUF) to fetch; the manifest comes from peers")
    fetch.add_argument("--manifest", help="a manifest JSON file instead of asking peers")
    fetch.add_argument("--manifest-id", help="only accept a manifest with this id")
    fetch.add_argument("--range", type=argtypes.layer_range, help="layers START:END (default: the whole model)")
    fetch.add_argument("--peer", type=argtypes.peer, action="append",
                       help="extra torrent peer HOST:PORT (repeatable)")
    fetch.add_argument("--timeout", type=argtypes.at_least(0.001, float), default=600.0,
                       help="give up after this many seconds")
    fetch.add_argument("--seed-after", action="store_true", help="keep seeding after the fetch until stopped")
    fetch.add_argument("--quiet", action="store_true", help="no progress bar")
    seed = commands.add_parser("seed", help="verify the store and seed a model to the swarm until stopped")
    seed.add_argument("model_id", help="model id (or unique prefix) in the store")
    for p in (fetch, seed):
        p.add_argument("--node-id", default="artifact-node", help="id in announcements and progress subjects")
        p.add_argument("--nats-url", help="NATS server (default: $SWARMROUTE_NATS_URL)")
        p.add_argument("--connect-timeout", type=argtypes.at_least(0.001, float), default=10.0,
                       help="seconds to reach NATS at start")
        p.add_argument("--listen-host", default="127.0.0.1", help="torrent listen address (loopback/private)")
        p.add_argument("--listen-port", type=argtypes.port, default=0, help="torrent listen port (0: any free port)")
        p.add_argument("--download-limit", type=argtypes.at_least(0), default=0, help="bytes/s, 0 for unlimited")
        p.add_argument("--upload-limit", type=argtypes.at_least(0), default=0, help="bytes/s, 0 for unlimited")
        p.set_defaults(func=guarded(lambda args: asyncio.run(_run(args))))
    synthetic = commands.add_parser(
        "synthetic", help="write the seeded synthetic GGUF the shard matrix uses for an architecture (no download), "
                          "to check a llama.cpp build against the matrix")
    synthetic.add_argument("--arch", required=True, help="GGUF architecture (llama, gemma3, deepseek4, ...)")
    synthetic.add_argument("--out", required=True, help="output GGUF path")
    synthetic.add_argument("--seed", type=argtypes.at_least(0), default=16,
                           help="weight seed (default 16, the matrix's)")
    synthetic.add_argument("--width", choices=("tiny", "real"), default="tiny",
                           help="tiny (the matrix model) or real (the real model's widths, few layers and experts)")
    synthetic.add_argument("--quant", choices=("F16", "Q8_0", "Q4_0"),
                           help="weight type (default F16 tiny, Q8_0 real)")
    synthetic.set_defaults(func=guarded(_cmd_synthetic))
    for p in (shard, fetch, verify, seed):
        add_unproven_option(p)
    for p in (build, verify, shard, fetch, seed):
        p.add_argument("--home", help="swarmroute home (default: $SWARMROUTE_HOME or ~/.cache/swarmroute)")
