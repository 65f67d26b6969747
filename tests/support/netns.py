"""Separate hosts on one machine: network namespaces joined by a bridge (ip netns + veth, as root).

Only these self-made addresses (and loopback) are ever targeted by test traffic.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator


def available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"srprobe{os.getpid() % 10000}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(argv, check=True, capture_output=True)


@contextlib.contextmanager
def hosts(count: int, subnet: int = 213) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """Yields (bridge address, [(namespace, address)]): host i is 10.<subnet>.0.<i+2>/24 behind bridge .1."""
    tag = f"{os.getpid() % 100000}"
    bridge = f"srbr{tag}"
    made: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"10.{subnet}.0.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        result = []
        for i in range(count):
            ns, outer, inner = f"srns{tag}x{i}", f"srv{tag}x{i}", f"srp{tag}x{i}"
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            made.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            address = f"10.{subnet}.0.{i + 2}"
            _ip("addr", "add", f"{address}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            result.append((ns, address))
        yield f"10.{subnet}.0.1", result
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
