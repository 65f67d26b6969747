"""``swarmroute artifact ...``: build, verify and shard model artifacts (``fetch``/``seed`` come from
``actors.artifact_sync``, which needs NATS). Run standalone as ``python -m artifacts.cli artifact ...``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from artifacts.bundled import bundled_model_path
from artifacts.manifest import build_manifest, save_manifest
from artifacts.shard import ShardSource, write_shard
from artifacts.store import Store
from artifacts.verify import StoreReport, verify_shard, verify_store
from schemas.errors import SwarmrouteError
from schemas.settings import Settings

BUNDLED = "bundled"


def parse_range(text: str) -> tuple[int, int]:
    """``a:b`` -> (a, b), the half-open layer range [a, b)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layer range {text!r} must look like START:END, e.g. 0:9") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"layer range {text!r} must satisfy 0 <= START < END")
    return a, b


def home_of(args: argparse.Namespace) -> Path:
    return Path(args.home) if args.home else Settings().home


def model_source(args: argparse.Namespace) -> Path:
    return bundled_model_path(home_of(args)) if args.model == BUNDLED else Path(args.model)


def _cmd_build(args: argparse.Namespace) -> int:
    source = model_source(args)
    started = time.perf_counter()
    if args.no_import:
        manifest = build_manifest(source, piece_size=args.piece_size)
    else:
        manifest = Store(home_of(args)).import_gguf(source, link=args.link, piece_size=args.piece_size)
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
    store = Store(home_of(args))
    ids = [store.resolve(args.model_id)] if args.model_id else store.model_ids()
    if not ids:
        print(f"no model artifacts in {store.root}", file=sys.stderr)
        return 1
    failed = False
    for model_id in ids:
        report = verify_store(store, model_id)
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
    a, b = args.range
    if args.source:
        out = Path(args.out or f"shard-{a}-{b}.gguf")
        write_shard(Path(args.source), out, a, b)
        print(out)
        return 0
    store = Store(home_of(args))
    manifest = store.load(store.resolve(args.model_id))
    out = Path(args.out) if args.out else store.shard_path(manifest.model_id, a, b)
    write_shard(ShardSource.from_manifest(manifest, store.data_path(manifest)), out, a, b)
    verdict = verify_shard(manifest, out, a, b)
    print(verdict.describe())
    return 0 if verdict.ok else 1


def guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command function that reports a SwarmrouteError as one line on stderr and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(handler(args))
        except SwarmrouteError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 2

    return run


def artifact_group(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    """The sub-commands of ``artifact`` under ``subparsers``, created on first use (both this module and
    ``actors.artifact_sync`` add to it, in either order)."""
    existing = subparsers.choices.get("artifact")
    if existing is not None:
        return cast("argparse._SubParsersAction", existing.artifact_commands)  # type: ignore[type-arg]
    group: argparse.ArgumentParser = subparsers.add_parser(
        "artifact", help="model artifacts: manifests, shards, verification, swarm")
    commands: argparse._SubParsersAction = group.add_subparsers(  # type: ignore[type-arg]
        dest="artifact_command", required=True)
    group.artifact_commands = commands  # type: ignore[attr-defined]
    return commands


def register(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    """Add ``artifact build|verify|shard`` to the top-level ``subparsers``; returns the artifact sub-commands.
    Each command sets ``func(args) -> int``."""
    commands = artifact_group(subparsers)

    build = commands.add_parser("build", help="write the manifest of a GGUF and add it to the store")
    build.add_argument("model", help=f"path of a GGUF file, or '{BUNDLED}' for the bundled Gemma 3 270M")
    build.add_argument("--out", help="also write the manifest JSON here")
    build.add_argument("--piece-size", type=int, default=None, help="torrent piece size (power of two)")
    build.add_argument("--link", action="store_true", help="hard-link the file into the store instead of copying")
    build.add_argument("--no-import", action="store_true", help="only build the manifest, leave the store alone")
    build.set_defaults(func=guarded(_cmd_build))

    verify = commands.add_parser("verify", help="check what the store holds; print what it can serve and why not")
    verify.add_argument("model_id", nargs="?", help="model id (or unique prefix); default: every model")
    verify.add_argument("--range", type=parse_range, help="exit 1 unless this layer range START:END is servable")
    verify.add_argument("--json", action="store_true", help="machine-readable report")
    verify.set_defaults(func=guarded(_cmd_verify))

    shard = commands.add_parser("shard", help="write (and verify) the shard GGUF of a layer range")
    shard.add_argument("model_id", nargs="?", help="model id (or prefix) in the store")
    shard.add_argument("--range", type=parse_range, required=True, help="layers START:END")
    shard.add_argument("--source", help="write from this complete GGUF instead of the store")
    shard.add_argument("--out", help="output path (default: the store's shard path)")
    shard.set_defaults(func=guarded(_cmd_shard))

    for p in (build, verify, shard):
        p.add_argument("--home", help="swarmroute home (default: $SWARMROUTE_HOME or ~/.cache/swarmroute)")
    return commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="swarmroute")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
