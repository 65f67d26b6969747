"""The node process's resident memory, for its advertisement (the gateway's dashboard shows it per node)."""

from __future__ import annotations

import os
from pathlib import Path

_STATM = Path("/proc/self/statm")


def resident_bytes() -> int:
    """Resident set size of this process (weights, KV and everything else it touched); 0 where /proc is absent."""
    try:
        pages = int(_STATM.read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
