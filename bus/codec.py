"""msgpack codec for wire models on NATS: compact, schema-tolerant, and readable by any language."""

from __future__ import annotations

from typing import TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class DecodeError(ValueError):
    """A message did not decode into the expected model; ``str()`` says which field and why."""


def encode(model: BaseModel) -> bytes:
    data: bytes = msgpack.packb(model.model_dump(mode="json", exclude_none=False), use_bin_type=True)
    return data


def decode(data: bytes, model: type[M]) -> M:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise DecodeError(f"not a msgpack {model.__name__}: {exc}") from exc
    if not isinstance(raw, dict):
        raise DecodeError(f"{model.__name__} must be a msgpack map, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise DecodeError(f"invalid {model.__name__}: {exc.errors(include_url=False)}") from exc
