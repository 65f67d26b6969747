"""A dishonest torrent peer for tests: claims every piece of a (corrupted) file without checking it, and serves it.

``python tests/support/corrupt_peer.py MANIFEST.json DIR`` where ``DIR/model.gguf`` holds the bad bytes. Prints
``{"port": N}`` once listening, then serves until killed. Production code never skips the hash check; this script
bypasses ``artifacts.torrent`` on purpose to stand in for a buggy or malicious node.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import libtorrent as lt

from artifacts.manifest import load_manifest, torrent_bytes


def main(manifest_path: str, directory: str) -> None:
    manifest = load_manifest(Path(manifest_path))
    session = lt.session({"listen_interfaces": "127.0.0.1:0", "enable_dht": False, "enable_lsd": False,
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
    print(json.dumps({"port": session.listen_port()}), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
