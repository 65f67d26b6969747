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


class Terminal(io.StringIO):
    """What a person's terminal is to the printer: a stream whose ``isatty()`` is True."""

    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_bar_is_redrawn_in_place_and_ends_with_a_newline() -> None:
    out = Terminal()
    printer = ProgressPrinter(out, interval_s=3600)
    assert printer.tty
    printer(progress(pieces_done=25))
    printer(progress(pieces_done=50, bytes_downloaded=100_000_000))  # within the interval: still redrawn
    assert "\n" not in out.getvalue()  # one line, rewritten: no scrolling while the fetch runs
    redraws = out.getvalue().split("\r\x1b[2K")  # carriage return, then erase the whole line
    assert redraws[0] == "" and len(redraws) == 3
    assert redraws[1] == format_progress(progress(pieces_done=25))
    assert redraws[2] == format_progress(progress(pieces_done=50, bytes_downloaded=100_000_000))
    printer(progress(phase="done", pieces_done=100, bytes_downloaded=200_000_000, eta_s=None))
    final = out.getvalue().split("\r\x1b[2K")[-1]
    assert final == format_progress(progress(phase="done", pieces_done=100, bytes_downloaded=200_000_000,
                                             eta_s=None)) + "\n"  # the last state stays on screen
    assert out.getvalue().count("\n") == 1


def test_on_a_terminal_a_failed_fetch_also_ends_its_line() -> None:
    out = Terminal()
    printer = ProgressPrinter(out)
    printer(progress())
    printer(progress(phase="failed", message="no peer holds layers [6, 9)"))
    assert out.getvalue().endswith("- no peer holds layers [6, 9)\n")
    assert out.getvalue().count("\r\x1b[2K") == 2
