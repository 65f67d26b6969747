"""Measured figures for docs/reliability.md: tests record what they observed; nothing is written unless asked.

Set ``SWARMROUTE_FIGURES=/tmp/swarmroute-figures.json`` and run the hardening tests; each test merges its numbers
under its own section, so the doc cites numbers from a real run rather than hand-written ones.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "SWARMROUTE_FIGURES"


def record(section: str, **values: Any) -> None:
    """Merge ``values`` into ``section`` of the figures file (if ``SWARMROUTE_FIGURES`` is set); also print them."""
    print(f"[figures] {section}: {json.dumps(values, sort_keys=True, default=str)}")
    target = os.environ.get(ENV)
    if not target:
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data: dict[str, Any] = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
        entry = data.setdefault(section, {})
        entry.update(values)
        entry["recorded_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))


def add(section: str, key: str, amount: int = 1) -> None:
    """Add to a counter of ``section`` (e.g. faults injected per kind across several tests)."""
    target = os.environ.get(ENV)
    current = 0
    if target and Path(target).exists() and Path(target).stat().st_size:
        current = int(json.loads(Path(target).read_text()).get(section, {}).get(key, 0))
    record(section, **{key: current + amount})
