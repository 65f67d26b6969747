"""A terminal progress bar for fetches: redrawn in place on a TTY, one line per few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from schemas.artifact import FetchProgress


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def format_progress(p: FetchProgress, width: int = 28) -> str:
    filled = int(round(width * p.fraction))
    bar = "#" * filled + "-" * (width - filled)
    line = (f"[{p.start},{p.end}) {p.phase:<9} [{bar}] {100 * p.fraction:5.1f}% {p.pieces_done}/{p.pieces_wanted} pcs "
            f"{_mb(p.bytes_downloaded)}/{_mb(p.bytes_needed)} MB {_mb(p.rate_bps)} MB/s {p.peers} peers")
    if p.eta_s is not None and p.phase == "fetching":
        line += f" ETA {_duration(p.eta_s)}"
    if p.hash_failures:
        line += f" {p.hash_failures} bad pieces refetched"
    if p.banned_peers:
        line += f" banned: {', '.join(p.banned_peers)}"
    return line + (f" - {p.message}" if p.message else "")


class ProgressPrinter:
    """Callable progress sink for ``artifacts.fetch.fetch_range``."""

    def __init__(self, stream: TextIO | None = None, *, interval_s: float = 2.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = interval_s
        self._last_phase: tuple[str, str, int] = ("", "", 0)
        self._last_print = 0.0

    def __call__(self, p: FetchProgress) -> None:
        line = format_progress(p)
        if self.tty:
            end = "\n" if p.phase in ("done", "failed") else ""
            self.stream.write("\r\x1b[2K" + line + end)
            self.stream.flush()
            return
        now = time.monotonic()
        changed = (p.phase, p.message, len(p.banned_peers)) != self._last_phase
        if changed or now - self._last_print >= self.interval_s:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_phase, self._last_print = (p.phase, p.message, len(p.banned_peers)), now
