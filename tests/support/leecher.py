"""A peer that downloads a whole model from one holder over and over, so the holder keeps uploading for as long as
it runs (tests/bench/bench_seed_while_serving.py, and the tests of a node seeding under load). No verification,
no shard: only the transfer a joining node costs the holder. The child runs at the lowest CPU priority (niceness
19, its libtorrent threads too), standing in for a peer on another machine as far as one machine allows, and prints
one line per second: ``bytes <total received>``.

``Leecher(manifest, "HOST:PORT", scratch)`` runs ``python -m tests.support.leecher --manifest ... --peer ... --dir
...`` as a child process; SIGTERM (``stop()``) ends it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from artifacts.manifest import load_manifest
from artifacts.torrent import SwarmConfig, TorrentSession


class Leecher:
    """The child process; ``received`` is the total payload it has received so far (updated every second)."""

    def __init__(self, manifest: Path, peer: str, scratch: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.leecher", "--manifest", str(manifest),
                                      "--peer", peer, "--dir", str(scratch)], stdout=subprocess.PIPE, text=True)
        self.received = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("bytes "):
                self.received = int(line.split()[1])

    def wait_downloading(self, timeout: float = 60.0) -> None:
        """Until the first bytes arrived from the holder."""
        deadline = time.monotonic() + timeout
        while self.received == 0:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"the leecher received nothing from the holder (exit {self.proc.poll()})")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", type=Path, required=True)
    p.add_argument("--peer", required=True, help="HOST:PORT of the holder")
    p.add_argument("--dir", type=Path, required=True, help="scratch directory (emptied before every download)")
    args = p.parse_args()
    os.nice(19)
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    manifest = load_manifest(args.manifest)
    host, _, port = args.peer.rpartition(":")
    everything = list(range(manifest.torrent.n_pieces))
    received, next_print = 0, time.monotonic()
    while not stop:
        shutil.rmtree(args.dir, ignore_errors=True)
        session = TorrentSession(SwarmConfig(nice=19))  # a fresh one per download: removal is asynchronous
        job = session.add(manifest, args.dir, everything)
        got = 0
        while not stop and job.wanted_done() < len(everything):
            job.connect([(host, int(port))])
            session.pump(0.1)
            got = int(job.status().total_payload_download)
            if time.monotonic() >= next_print:
                print(f"bytes {received + got}", flush=True)
                next_print = time.monotonic() + 1.0
        received += got
        session.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
