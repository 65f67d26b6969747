"""argparse types for every numeric, size and range option: a value of the wrong form is an argparse error that
shows the expected form (``--nodes 3`` is not read as one node of 3 bytes)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

from artifacts.layer_split import NodeSpec, parse_nodes, parse_tokens
from schemas.errors import BadRequestError
from schemas.node import ALL_LAYERS, AllLayers, LayerRange
from schemas.session import CONTEXT_CAP

__all__ = ["at_least", "context", "fraction", "hidden_shape", "layer_range", "layers_or_all", "node_count_sizes",
           "node_size", "non_negative", "peer", "piece_size", "port", "positive", "power_of_two", "size", "tokens"]


def _number(kind: type[int] | type[float], text: str, what: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun} ({what})") from None


def at_least(minimum: float, kind: type[int] | type[float] = int, *, maximum: float | None = None,
             what: str = "") -> Callable[[str], int | float]:
    """A number in ``[minimum, maximum]``."""
    bounds = f">= {minimum:g}" + (f" and <= {maximum:g}" if maximum is not None else "")
    expected = what or f"expected {bounds}"

    def parse(text: str) -> int | float:
        value = _number(kind, text, expected)
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {bounds}")
        return value

    parse.__name__ = f"{kind.__name__} {bounds}"  # argparse names the type in its messages
    return parse


positive = at_least(1)
"""An integer >= 1 (sessions, nodes, layers, threads)."""

non_negative = at_least(0, float)
"""A number >= 0 (seconds, delays)."""

port = at_least(0, maximum=65535, what="a TCP port, 0..65535 (0: any free port)")

fraction = at_least(0, float, maximum=0.99, what="a fraction in [0, 1)")


def layer_range(text: str) -> tuple[int, int]:
    """``START:END``, the half-open layer range ``[START, END)``."""
    try:
        parsed = LayerRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return parsed.start, parsed.end


def hidden_shape(text: str) -> tuple[int, ...]:
    """``64`` or ``4x64``: one position's hidden shape."""
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r} is not a hidden shape like 64 or 4x64")
    return dims


def power_of_two(minimum: int = 1) -> Callable[[str], int]:
    """A power of two of at least ``minimum`` bytes: a plain number of bytes (``262144``) or a size with its unit
    (``256KiB``, ``1MiB``)."""
    floor = f"{minimum} bytes" if minimum < 1024 else f"{minimum >> 10} KiB"
    form = f"a power of two of at least {floor}, e.g. {max(minimum, 1 << 16)} or 1MiB"

    def parse(text: str) -> int:
        value = None
        if text.strip().isdigit():
            value = int(text)
        elif "x" not in text.lower():  # NxSIZE is a node list, not one size
            with contextlib.suppress(argparse.ArgumentTypeError):
                value = _sizes(text)[0].memory_bytes
        if value is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not a size: give {form}")
        if value < minimum or value & (value - 1):
            bytes_ = "" if text.strip().isdigit() else f" ({value} bytes)"
            raise argparse.ArgumentTypeError(f"{text}{bytes_} is not {form}")
        return value

    parse.__name__ = "power of two"  # argparse names the type in its messages
    return parse


piece_size = power_of_two(16 << 10)
"""A torrent piece size: what ``artifacts.manifest.build_manifest`` accepts (a power of two >= 16 KiB)."""


def node_size(text: str) -> list[NodeSpec]:
    """One node's memory with its unit: ``24GB``, ``80GiB``, ``512MiB`` (a bare number is refused)."""
    if text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} has no unit: give a size like 24GB, 80GiB or 512MiB")
    return _sizes(text)


def size(text: str) -> int:
    """A memory size in bytes with its unit: ``24GB``, ``80GiB``, ``512MiB`` (GB = GiB = 2^30; a bare number is
    refused)."""
    if "x" in text.lower():
        raise argparse.ArgumentTypeError(f"{text!r} is one size, not NxSIZE: give e.g. 24GB")
    return node_size(text)[0].memory_bytes


def node_count_sizes(text: str) -> list[NodeSpec]:
    """Several equal nodes: ``NxSIZE``, e.g. ``4x24GB`` (``3`` alone is refused: count and size both)."""
    if "x" not in text.lower() or text.lower().rstrip().endswith("x"):
        raise argparse.ArgumentTypeError(f"{text!r} is not NxSIZE: give a count and a size, e.g. 3x24GB")
    count, _, size = text.lower().partition("x")
    if not count.strip().isdigit() or size.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not NxSIZE: give a count and a size, e.g. 3x24GB")
    return _sizes(text)


def _sizes(text: str) -> list[NodeSpec]:
    try:
        return parse_nodes([text])
    except BadRequestError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def tokens(text: str) -> int:
    """A token count: ``131072``, ``128K`` or ``1M``."""
    try:
        value = parse_tokens(text)
    except BadRequestError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one token")
    return value


def context(text: str) -> int:
    """Tokens of context per session: ``4096``, ``32K``, at most the product's 128K."""
    value = tokens(text)
    if value > CONTEXT_CAP:
        raise argparse.ArgumentTypeError(f"{text!r} exceeds the {CONTEXT_CAP // 1024}K-token context cap")
    return value


def layers_or_all(text: str) -> tuple[int, int] | AllLayers:
    """``START:END``, or ``all`` for the whole model: ``ALL_LAYERS``, not ``None`` (the option's absence, which lets
    a node joining from the swarm ask the tracker for a range)."""
    return ALL_LAYERS if text.strip().lower() == "all" else layer_range(text)


def peer(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of a torrent peer on a loopback or private address."""
    from artifacts.torrent import is_private_address  # libtorrent: only when the option is used

    host, _, number = text.rpartition(":")
    host = host.strip("[]")
    if not host or not number.isdigit() or not 0 < int(number) < 65536 or not is_private_address(host):
        raise argparse.ArgumentTypeError(f"peer {text!r} must be HOST:PORT with a loopback or private HOST")
    return host, int(number)
