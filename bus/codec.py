"""msgpack codec for wire models on NATS: compact, schema-tolerant, and readable by any language."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class DecodeError(ValueError):
    """A message did not decode into the expected model; ``str()`` says which field and why."""


def encode(model: BaseModel) -> bytes:
    data: bytes = msgpack.packb(model.model_dump(mode="json", exclude_none=False), use_bin_type=True)
    return data


def _unpack(data: bytes, what: str) -> dict[str, Any]:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise DecodeError(f"not a msgpack {what}: {exc}") from exc
    if not isinstance(raw, dict):
        raise DecodeError(f"{what} must be a msgpack map, got {type(raw).__name__}")
    return raw


def decode(data: bytes, model: type[M]) -> M:
    raw = _unpack(data, model.__name__)
    return _validate(raw, model)


def decode_tagged(data: bytes, models: Mapping[str, type[BaseModel]]) -> BaseModel:
    """A message of a subject that carries several models, chosen by its ``type`` tag."""
    raw = _unpack(data, " or ".join(m.__name__ for m in models.values()))
    tag = raw.get("type")
    model = models.get(tag) if isinstance(tag, str) else None
    if model is None:
        raise DecodeError(f"message type {tag!r} is not one of {sorted(models)}")
    return _validate(raw, model)


def _validate(raw: dict[str, Any], model: type[M]) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise DecodeError(f"invalid {model.__name__}: {exc.errors(include_url=False)}") from exc
