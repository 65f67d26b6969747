"""The on-disk cache of prepared torch models, and reading only the tensors a shard needs.

A prepared model is a directory under ``<home>/torch/``: ``config.json``, a tokenizer, and weights as safetensors.
Several nodes (processes) may prepare the same model at once, so every directory is built under a lock into a
temporary sibling and renamed into place: a reader never sees a half-written model.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open


class TensorSource(Protocol):
    """Named weight tensors (transformers state-dict names), read one at a time so nothing else is materialized."""

    def read(self, names: list[str]) -> dict[str, torch.Tensor]: ...


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (flock) held for the block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_dir(path: Path, build: Callable[[Path], None]) -> Path:
    """Return ``path``, first building it with ``build(tmp_dir)`` unless another process already did."""
    if path.is_dir():
        return path
    with locked(path.parent / f".{path.name}.lock"):
        if path.is_dir():
            return path
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            build(tmp)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path


def ensure_file(path: Path, write: Callable[[Path], None]) -> Path:
    """Return ``path``, first writing it with ``write(tmp_file)`` unless another process already did."""
    if path.is_file():
        return path
    with locked(path.parent / f".{path.name}.lock"):
        if path.is_file():
            return path
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            write(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path


class SafetensorsSource:
    """A transformers checkpoint directory (``model.safetensors`` or a sharded index); reads tensors by name."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: directory / file for name, file in weight_map.items()}
        else:
            single = directory / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
            with safe_open(str(single), framework="pt") as handle:
                self._file_of = {name: single for name in handle.keys()}  # noqa: SIM118 (safe_open is no dict)

    def names(self) -> set[str]:
        return set(self._file_of)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self._file_of]
        if missing:
            raise KeyError(f"tensors not in {self.directory}: {missing}")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._file_of[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for name in wanted:
                    out[name] = handle.get_tensor(name)
        return out
