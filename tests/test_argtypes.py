"""Every numeric, size and range option refuses a value of the wrong form with an argparse error showing the
expected form, through the real ``swarmroute`` command line."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest

from schemas.node import ALL_LAYERS
from swarmroute import argtypes
from swarmroute.cli import build_parser, main


def _refused(argv: list[str]) -> str:
    """The message argparse prints for ``swarmroute <argv>``; the exit status must be argparse's 2."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2, err.getvalue()
    return err.getvalue()


def test_plan_nodes_3_is_an_argparse_error_showing_nxsize() -> None:
    """The report that started it: ``--nodes 3`` was read as one node of 3 bytes."""
    message = _refused(["plan", "model.gguf", "--nodes", "3"])
    assert "argument --nodes: '3' is not NxSIZE: give a count and a size, e.g. 3x24GB" in message
    assert "usage: swarmroute plan" in message
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        main(["plan", "model.gguf", "--nodes", "3"])
    assert "NxSIZE" in err.getvalue()


@pytest.mark.parametrize(("argv", "expected"), [
    (["plan", "m.gguf", "--node", "3"], "'3' has no unit: give a size like 24GB"),
    (["plan", "m.gguf", "--nodes", "3x"], "is not NxSIZE"),
    (["plan", "m.gguf", "--nodes", "x24GB"], "is not NxSIZE"),
    (["plan", "m.gguf", "--nodes", "2x24"], "is not NxSIZE"),
    (["plan", "m.gguf", "--nodes", "2x24XB"], "is not like 24GB, 80GiB or 4x24GB"),
    (["plan", "m.gguf", "--node", "24GB", "--context", "lots"], "is not like 131072, 128K or 1M"),
    (["plan", "m.gguf", "--node", "24GB", "--sessions", "0"], "0 is out of range: expected >= 1"),
    (["plan", "m.gguf", "--node", "24GB", "--reserve", "1.5"], "1.5 is out of range: expected >= 0 and <= 0.99"),
    (["up", "--nodes", "0"], "0 is out of range: expected >= 1"),
    (["up", "--nodes", "two"], "'two' is not an integer"),
    (["up", "--port", "70000"], "70000 is out of range"),
    (["up", "--max-sessions", "-1"], "-1 is out of range: expected >= 1"),
    (["up", "--ctx", "200K"], "exceeds the 128K-token context cap"),
    (["up", "--ctx", "abc"], "is not like 131072, 128K or 1M"),
    (["up", "--threads", "0"], "0 is out of range: expected >= 1"),
    (["up", "--backend", "stub", "--hidden-shape", "4x0"], "is not a hidden shape like 64 or 4x64"),
    (["up", "--backend", "stub", "--stub-delay", "-0.5"], "-0.5 is out of range: expected >= 0"),
    (["node", "--layers", "9:3"], "layer range '9:3' is empty: END must be greater than START"),
    (["node", "--layers", "first"], "'first' is not a layer range START:END"),
    (["node", "--port", "-2"], "is out of range"),
    (["gateway", "--port", "http"], "'http' is not an integer"),
    (["watch", "--duration", "-3"], "-3 is out of range: expected >= 0"),
    (["fleet", "up", "f.yaml", "--timeout", "0"], "0 is out of range: expected >= 0.001"),
    (["artifact", "verify", "--range", "3"], "'3' is not a layer range START:END"),
    (["artifact", "fetch", "--peer", "8.8.8.8:6881"], "must be HOST:PORT with a loopback or private HOST"),
    (["artifact", "fetch", "--peer", "127.0.0.1:0"], "must be HOST:PORT"),
    (["artifact", "fetch", "--download-limit", "-5"], "-5 is out of range: expected >= 0"),
    (["artifact", "build", "x.gguf", "--piece-size", "0"], "0 is not a power of two of at least 16 KiB"),
    (["artifact", "build", "x.gguf", "--piece-size", "100000"], "100000 is not a power of two of at least 16 KiB"),
    (["artifact", "build", "x.gguf", "--piece-size", "8KiB"], "8KiB (8192 bytes) is not a power of two of at least"),
    (["artifact", "build", "x.gguf", "--piece-size", "big"], "'big' is not a size: give a power of two of at least"),
    (["node", "--memory", "24"], "'24' has no unit: give a size like 24GB"),
    (["node", "--memory", "2x24GB"], "'2x24GB' is one size, not NxSIZE: give e.g. 24GB"),
    (["node", "--memory", "lots"], "'lots' is not like 24GB, 80GiB or 4x24GB"),
    (["up", "--from-swarm", "--node-memory", "512"], "'512' has no unit: give a size like 24GB"),
    (["up", "--node-memory", "3x1GiB"], "is one size, not NxSIZE"),
    (["node", "--torrent-port", "70000"], "70000 is out of range: expected >= 0 and <= 65535"),
    (["node", "--torrent-port", "any"], "'any' is not an integer (a TCP port, 0..65535 (0: any free port))"),
    (["artifact", "fetch", "--listen-port", "-1"], "-1 is out of range: expected >= 0 and <= 65535"),
    (["artifact", "seed", "m", "--listen-port", "65536"], "65536 is out of range"),
    (["seeder", "bundled", "--listen-port", "port"], "'port' is not an integer"),
    (["artifact", "seed", "m", "--upload-limit", "-1"], "-1 is out of range: expected >= 0"),
    (["artifact", "fetch", "--upload-limit", "1.5"], "'1.5' is not an integer"),
    (["seeder", "bundled", "--upload-limit", "-100"], "-100 is out of range: expected >= 0"),
    (["artifact", "fetch", "--connect-timeout", "0"], "0 is out of range: expected >= 0.001"),
    (["artifact", "seed", "m", "--connect-timeout", "soon"], "'soon' is not a number"),
    (["artifact", "fetch", "--timeout", "0"], "0 is out of range: expected >= 0.001"),
    (["artifact", "fetch", "--timeout", "-30"], "-30 is out of range: expected >= 0.001"),
    (["artifact", "fetch", "--timeout", "10m"], "'10m' is not a number"),
])
def test_bad_values_are_argparse_errors_naming_the_option_and_the_form(argv: list[str], expected: str) -> None:
    message = _refused(argv)
    option = next(a for a in reversed(argv) if a.startswith("--"))
    assert f"argument {option}" in message, message
    assert expected in message, message


def test_good_values_parse_to_what_the_commands_use() -> None:
    args = build_parser().parse_args(["up", "--nodes", "3", "--ctx", "32K", "--port", "0", "--backend", "stub",
                                      "--hidden-shape", "4x64", "--stub-delay", "0.25", "--threads", "2"])
    assert (args.nodes, args.ctx, args.port, args.hidden_shape, args.stub_delay, args.threads) == (
        3, 32768, 0, (4, 64), 0.25, 2)
    node = build_parser().parse_args(["node", "--layers", "0:9"])
    assert node.layers == (0, 9)
    # ``all`` is the whole model, not the option's absence (which makes a node from the swarm ask the tracker)
    assert build_parser().parse_args(["node", "--layers", "all"]).layers == ALL_LAYERS
    assert build_parser().parse_args(["node", "--layers", " ALL "]).layers == ALL_LAYERS
    assert build_parser().parse_args(["node"]).layers is None
    plan = build_parser().parse_args(["plan", "m.gguf", "--nodes", "2x24GB", "--node", "512MiB"])
    assert [n.memory_bytes for group in plan.nodes for n in group] == [24 * 2**30] * 2
    assert plan.node[0][0].memory_bytes == 512 * 2**20
    fetch = build_parser().parse_args(["artifact", "fetch", "--peer", "10.1.2.3:6881", "--range", "0:9",
                                       "--timeout", "2.5", "--connect-timeout", "0.5", "--listen-port", "6881",
                                       "--upload-limit", "1000"])
    assert fetch.peer == [("10.1.2.3", 6881)] and fetch.range == (0, 9)
    assert (fetch.timeout, fetch.connect_timeout, fetch.listen_port, fetch.upload_limit) == (2.5, 0.5, 6881, 1000)
    joining = build_parser().parse_args(["node", "--memory", "512MiB", "--torrent-port", "6882"])
    assert (joining.memory, joining.torrent_port) == (512 * 2**20, 6882)
    assert build_parser().parse_args(["up", "--node-memory", "1GiB"]).node_memory == 2**30
    pieces = [build_parser().parse_args(["artifact", "build", "x.gguf", "--piece-size", s]).piece_size
              for s in ("16384", "256KiB", "1MiB")]
    assert pieces == [16 << 10, 256 << 10, 1 << 20]


def test_power_of_two_takes_bytes_or_a_unit_and_names_the_form() -> None:
    parse = argtypes.power_of_two(1024)
    assert [parse(s) for s in ("1024", "4KiB", "2M")] == [1024, 4096, 2 << 20]
    with pytest.raises(argparse.ArgumentTypeError, match=r"^1536 is not a power of two of at least 1 KiB, e\.g\."):
        parse("1536")
    with pytest.raises(argparse.ArgumentTypeError, match=r"512 is not a power of two of at least 1 KiB"):
        parse("512")  # a power of two, but below the minimum
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        parse("4x1KiB")


def test_the_piece_size_the_parser_accepts_is_one_the_manifest_accepts(tmp_path: Path) -> None:
    """The argparse type and ``build_manifest`` agree: the smallest accepted size builds a manifest."""
    from artifacts.manifest import build_manifest
    from tests.support.gguf_factory import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf")
    size = build_parser().parse_args(["artifact", "build", str(path), "--piece-size", "16KiB"]).piece_size
    assert build_manifest(path, piece_size=size).torrent.piece_size == 16 << 10


def test_at_least_names_its_bounds_for_argparse() -> None:
    parse = argtypes.at_least(2, maximum=5)
    assert parse("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="expected >= 2 and <= 5"):
        parse("9")
