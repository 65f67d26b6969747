"""A dishonest torrent peer for tests: claims every piece of a (corrupted) file without checking it, and serves it.

``python tests/support/corrupt_peer.py MANIFEST.json DIR [--host ADDR] [--nats URL --node-id ID]`` where
``DIR/model.gguf`` holds the bad bytes. Prints ``{"port": N}`` once listening, then serves until killed. With
``--nats`` it also plays a seeder on the control plane: it announces itself on ``artifact_peers`` claiming every
layer as verified, answers ``artifact_peer_query``, and hands out the (genuine) manifest, so fetchers find it the
way they find an honest seeder. Production code never skips the hash check; this script bypasses
``artifacts.torrent`` on purpose to stand in for a buggy or malicious node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import zlib
from pathlib import Path

import libtorrent as lt

from artifacts.manifest import load_manifest, torrent_bytes
from bus.codec import encode
from bus.subjects import Subjects
from schemas.artifact import ArtifactPeer
from schemas.manifest import ModelManifest
from schemas.node import LayerRange


def serve_torrent(manifest: ModelManifest, directory: str, host: str) -> tuple[lt.session, int]:
    session = lt.session({"listen_interfaces": f"{host}:0", "enable_dht": False, "enable_lsd": False,
                          "enable_upnp": False, "enable_natpmp": False, "enable_outgoing_utp": False,
                          "enable_incoming_utp": False, "allow_multiple_connections_per_ip": True})
    atp = lt.add_torrent_params()
    atp.ti = lt.torrent_info(torrent_bytes(manifest))
    atp.save_path = directory
    atp.flags &= ~(lt.torrent_flags.auto_managed | lt.torrent_flags.paused)
    atp.have_pieces = [True] * manifest.torrent.n_pieces  # the lie: no hash check of what is on disk
    session.add_torrent(atp)
    while not session.listen_port():
        time.sleep(0.02)
    return session, int(session.listen_port())


async def pose_as_seeder(manifest: ModelManifest, url: str, node_id: str, host: str, port: int) -> None:
    import nats
    from nats.aio.msg import Msg

    nc = await nats.connect(url)
    subjects = Subjects()
    me = ArtifactPeer(node_id=node_id, model_id=manifest.model_id, manifest_id=manifest.manifest_id, host=host,
                      port=port, ranges=[LayerRange(start=0, end=manifest.n_layers)], complete=1.0)
    packed = zlib.compress(manifest.model_dump_json().encode())

    async def on_query(msg: Msg) -> None:
        await msg.respond(encode(me))

    async def on_manifest(msg: Msg) -> None:
        await msg.respond(packed)

    await nc.subscribe(subjects.artifact_peer_query(manifest.model_id), cb=on_query)
    await nc.subscribe(subjects.artifact_manifest(manifest.model_id), cb=on_manifest)
    while True:
        await nc.publish(subjects.artifact_peers(manifest.model_id), encode(me))
        await asyncio.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("manifest")
    parser.add_argument("directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--nats")
    parser.add_argument("--node-id", default="liar")
    args = parser.parse_args()
    manifest = load_manifest(Path(args.manifest))
    _session, port = serve_torrent(manifest, args.directory, args.host)
    print(json.dumps({"port": port, "host": args.host}), flush=True)
    if args.nats:
        asyncio.run(pose_as_seeder(manifest, args.nats, args.node_id, args.host, port))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
