"""A terminal progress bar for fetches: redrawn in place on a TTY, one line per few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from schemas.artifact import FetchProgress


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def format_progress(p: FetchProgress, width: int = 28) -> str:
    filled = int(round(width * p.fraction))
    bar = "#" * filled + "-" * (width - filled)
    line = (f"[{p.start},{p.end}) {p.phase:<9} [{bar}] {100 * p.fraction:5.1f}% {p.pieces_done}/{p.pieces_wanted} pcs "
            f"{_mb(p.bytes_downloaded)}/{_mb(p.bytes_needed)} MB {_mb(p.rate_bps)} MB/s {p.peers} peers")
    if p.hash_failures:
        line += f" {p.hash_failures} bad pieces refetched"
    return line + (f" - {p.message}" if p.message else "")


class ProgressPrinter:
    """Callable progress sink for ``artifacts.fetch.fetch_range``."""

    def __init__(self, stream: TextIO | None = None, *, interval_s: float = 2.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = interval_s
        self._last_phase = ""
        self._last_print = 0.0

    def __call__(self, p: FetchProgress) -> None:
        line = format_progress(p)
        if self.tty:
            end = "\n" if p.phase in ("done", "failed") else ""
            self.stream.write("\r\x1b[2K" + line + end)
            self.stream.flush()
            return
        now = time.monotonic()
        if p.phase != self._last_phase or now - self._last_print >= self.interval_s:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_phase, self._last_print = p.phase, now
