"""Reading a fleet from disk and its secrets from the machine that runs a member: the only file and environment
reading a fleet needs (``schemas.fleet`` only parses and validates)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import SecretStr

from schemas.errors import BadRequestError
from schemas.fleet import Fleet, SecretRef, parse_fleet

__all__ = ["load_fleet", "resolve_secret"]


def load_fleet(path: Path) -> Fleet:
    """The fleet file at ``path`` (YAML, or TOML by its suffix), its relative paths resolved against its folder."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadRequestError(f"cannot read fleet file {path}: {exc.strerror}", code="invalid_fleet") from None
    fleet = parse_fleet(text, source=str(path), toml=path.suffix == ".toml")
    return fleet.with_base(path.resolve().parent)


def resolve_secret(ref: SecretRef) -> SecretStr:
    """Read a secret now; ``BadRequestError`` names the variable or file (never the value)."""
    if ref.env is not None:
        value = os.environ.get(ref.env)
        if value is None:
            raise BadRequestError(f"environment variable {ref.env} (a secret reference) is not set")
        return SecretStr(value)
    assert ref.file is not None
    try:
        return SecretStr(ref.file.read_text().rstrip("\r\n"))
    except OSError as exc:
        raise BadRequestError(f"cannot read secret file {ref.file}: {exc.strerror}") from None
