"""artifacts/progress.py: the fetch progress a person reads (a bar redrawn on a terminal, lines otherwise)."""

from __future__ import annotations

import io

from artifacts.progress import ProgressPrinter, format_progress
from schemas.artifact import FetchProgress
from schemas.node import LayerRange


def progress(**kw: object) -> FetchProgress:
    base: dict[str, object] = dict(node_id="n1", model_id="m", start=0, end=9, phase="fetching", pieces_done=25,
                                   pieces_wanted=100, bytes_downloaded=50_000_000, bytes_needed=200_000_000,
                                   rate_bps=10_000_000.0, peers=3, eta_s=95.0)
    base.update(kw)
    return FetchProgress.model_validate(base)


def test_the_line_has_bytes_rate_peers_and_eta() -> None:
    line = format_progress(progress())
    assert "25.0%" in line and "50.0/200.0 MB" in line and "10.0 MB/s" in line and "3 peers" in line
    assert "ETA 1m35s" in line
    assert "ETA" not in format_progress(progress(phase="verifying"))
    assert "ETA" not in format_progress(progress(eta_s=None))


def test_bans_and_waits_are_spelled_out() -> None:
    line = format_progress(progress(hash_failures=2, banned_peers=["10.0.0.2:6881"], eta_s=None,
                                    unseeded_layers=[LayerRange(start=6, end=9)],
                                    message="waiting for a peer that has layers [6, 9)"))
    assert "2 bad pieces refetched" in line and "banned: 10.0.0.2:6881" in line
    assert line.endswith("- waiting for a peer that has layers [6, 9)")


def test_without_a_terminal_lines_come_on_change_and_periodically() -> None:
    out = io.StringIO()
    printer = ProgressPrinter(out, interval_s=3600)
    printer(progress())
    printer(progress(pieces_done=30))  # same phase, no news: not repeated within the interval
    printer(progress(banned_peers=["10.0.0.2:6881"]))  # a ban is news
    printer(progress(phase="done", pieces_done=100))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "banned" in lines[1] and "done" in lines[2]
