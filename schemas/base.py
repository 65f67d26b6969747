"""The base of every wire model: versioned, tolerant of unknown fields."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

SCHEMA_VERSION = 1
"""Bumped only for incompatible changes; additive changes keep the version and rely on unknown-field tolerance."""


class WireModel(BaseModel):
    """A message that crosses a process boundary (NATS or HTTP).

    Unknown fields are kept rather than rejected so that a node speaking a newer minor revision of the protocol
    still interoperates; ``schema_version`` lets a receiver refuse what it cannot understand.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    schema_version: int = SCHEMA_VERSION


class WirePart(BaseModel):
    """A part nested in a wire message, versioned by its message: tolerant of unknown fields like ``WireModel``,
    without a ``schema_version`` of its own (some parts repeat per token, where every byte is paid per token)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
