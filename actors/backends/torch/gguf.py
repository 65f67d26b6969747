"""A GGUF file as a transformers model, converted piecewise and cached so a shard never dequantizes foreign layers.

transformers can load a whole GGUF (dequantizing every tensor). A node needs only its layers, so this module
uses transformers' own GGUF pieces (config parsing, tokenizer conversion, name map, tensor processors) but
dequantizes per *part*: the embeddings, one decoder layer, or the final norm/head. Each part is cached as
float32 safetensors under ``<cache>/<stem>-<key>/parts/`` the first time any node needs it; the config and the
tokenizer (slow to parse from GGUF: ~30 s each for a 262k vocabulary) are cached alongside.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from actors.backends.torch.store import ensure_dir, ensure_file
from actors.backends.torch.tokens import GEMMA_CHAT_TEMPLATE

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def part_of(hf_name: str) -> str:
    """The cache part a state-dict name belongs to: ``embed``, ``layer-0007`` or ``final``."""
    match = _LAYER.match(hf_name)
    if match:
        return f"layer-{int(match.group(1)):04d}"
    if hf_name.startswith("model.embed_tokens."):
        return "embed"
    return "final"


def cache_dir_for(gguf_path: Path, cache_root: Path) -> Path:
    """One directory per GGUF file version (name, size, mtime) and transformers version."""
    import transformers

    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode())
    return cache_root / f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class GGUFModel:
    """Config, tokenizer directory and tensors of one GGUF file, each prepared on first use."""

    def __init__(self, gguf_path: Path, cache_root: Path) -> None:
        self.gguf_path = gguf_path
        self.root = cache_dir_for(gguf_path, cache_root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._config: PretrainedConfig | None = None
        self._name_map: dict[str, str] | None = None
        self._reader: Any = None

    @property
    def name(self) -> str:
        return self.gguf_path.stem

    def sha256(self) -> str:
        def write(tmp: Path) -> None:
            tmp.write_text(file_sha256(self.gguf_path))

        return ensure_file(self.root / "sha256.txt", write).read_text().strip()

    def config(self) -> PretrainedConfig:
        if self._config is None:
            directory = ensure_dir(self.root / "config", self._write_config)
            self._config = AutoConfig.from_pretrained(str(directory))
        return self._config

    def _write_config(self, tmp: Path) -> None:
        config = AutoConfig.from_pretrained(str(self.gguf_path.parent), gguf_file=self.gguf_path.name)
        # The converted weights are plain float32: nothing is quantized once cached.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(str(tmp))

    def tokenizer_dir(self) -> Path:
        return ensure_dir(self.root / "tokenizer", self._write_tokenizer)

    def _write_tokenizer(self, tmp: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(str(self.gguf_path.parent), gguf_file=self.gguf_path.name)
        if tokenizer.chat_template is None and self.config().model_type.startswith("gemma"):
            tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
        tokenizer.save_pretrained(str(tmp))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        by_part: dict[str, list[str]] = {}
        for name in names:
            by_part.setdefault(part_of(name), []).append(name)
        paths = {part: ensure_file(self.root / "parts" / f"{part}.safetensors", self._part_writer(part))
                 for part in by_part}
        self._reader = None  # every needed part is on disk: let go of the GGUF mapping
        out: dict[str, torch.Tensor] = {}
        for part, wanted in by_part.items():
            with safe_open(str(paths[part]), framework="pt") as handle:
                available = set(handle.keys())
                missing = [n for n in wanted if n not in available]
                if missing:
                    raise KeyError(f"tensors not in {self.gguf_path.name}: {missing}")
                for name in wanted:
                    out[name] = handle.get_tensor(name)
        return out

    def _part_writer(self, part: str) -> Callable[[Path], None]:
        return lambda tmp: self._write_part(part, tmp)

    def _gguf_to_hf(self) -> dict[str, str]:
        if self._name_map is None:
            from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(self.config())  # type: ignore[no-untyped-call]
            self._name_map = dict(get_gguf_hf_weights_map(skeleton, self._processor()))
        return self._name_map

    def _processor(self) -> Any:
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        arch = self.config().model_type.removesuffix("_text")
        return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=self.config().to_dict())  # type: ignore[no-untyped-call]

    def _gguf_tensors(self) -> list[Any]:
        # Parsing the metadata takes ~10 s for a large vocabulary: once per process, only when a part is missing.
        if self._reader is None:
            from gguf import GGUFReader

            self._reader = GGUFReader(str(self.gguf_path))
        return list(self._reader.tensors)

    def _write_part(self, part: str, tmp: Path) -> None:
        from gguf import dequantize

        name_map = self._gguf_to_hf()
        processor = self._processor()
        tensors: dict[str, torch.Tensor] = {}
        for tensor in self._gguf_tensors():
            hf_name = name_map.get(tensor.name)
            if hf_name is None or part_of(hf_name) != part:
                continue
            weights = dequantize(tensor.data, tensor.tensor_type)
            result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=name_map,
                                       parsed_parameters={"config": self.config().to_dict(), "tensors": {}})
            target = name_map.get(result.name, hf_name)
            tensors[target] = torch.from_numpy(np.array(result.weights, dtype=np.float32, copy=True))
        if not tensors:
            raise KeyError(f"{self.gguf_path.name} has no tensors for part {part}")
        save_file(tensors, str(tmp), metadata={"source": self.gguf_path.name, "part": part})
