"""Where a torch backend's model comes from: a tiny seeded model, a transformers directory, or a GGUF file.

Every source ends up as a ``PreparedModel``: a config, a ``TensorSource`` a shard reads only its own tensors from,
and a tokenizer directory prepared on first use (middle nodes never need one). Tiny models are built in full once
(they are a few hundred kilobytes), saved under the cache and shared by every node, so nodes agree on the weights
without talking to each other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, PretrainedConfig

from actors.backends.torch.gguf import GGUFModel
from actors.backends.torch.store import SafetensorsSource, TensorSource, ensure_dir
from actors.backends.torch.tokens import TINY_SPECIALS, build_tiny_tokenizer
from schemas.errors import ModelNotFoundError

TINY_VOCAB = len(TINY_SPECIALS) + 256

TINY_INIT_STD = 0.15
"""Weight init std, larger than transformers' 0.02."""

TINY_NORM_GAIN = (1.0, 0.3)
"""Added to every norm weight (mean, std). With transformers' init a tiny random model (its tied head above all)
mostly echoes the last token, so a broken KV cache or mask could go unnoticed; gains around 2 let attention and
MLP outputs dominate the residual stream and make greedy streams varied and context-dependent."""


@dataclasses.dataclass
class PreparedModel:
    name: str
    config: PretrainedConfig
    tensors: TensorSource
    tokenizer_dir: Callable[[], Path]
    sha256: str = ""


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=TINY_INIT_STD,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )


def tiny_gemma3_config() -> Gemma3TextConfig:
    """Sliding window 16 and a global layer every third, so any 2- or 3-way split mixes both kinds."""
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16, layer_types=layer_types,
        max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=TINY_INIT_STD,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    )


TINY_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": tiny_llama_config,
    "tiny-gemma3": tiny_gemma3_config,
}


def tiny_model_dir(name: str, cache_root: Path, seed: int = 0) -> Path:
    """The directory of a tiny random model (config, safetensors, tokenizer), built once per config and seed."""
    import transformers

    config = TINY_MODELS[name]()
    fingerprint = json.dumps([config.to_dict(), seed, transformers.__version__], sort_keys=True, default=str)
    key = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]

    def build(tmp: Path) -> None:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name:
                    param.add_(torch.randn_like(param) * TINY_NORM_GAIN[1] + TINY_NORM_GAIN[0])
        model.save_pretrained(str(tmp))
        build_tiny_tokenizer().save_pretrained(str(tmp))

    return ensure_dir(cache_root / f"{name}-s{seed}-{key}", build)


def prepare(model: str, cache_root: Path, seed: int = 0) -> PreparedModel:
    """Resolve ``model``: ``tiny-llama`` / ``tiny-gemma3``, a ``.gguf`` file, or a transformers directory."""
    if model in TINY_MODELS:
        directory = tiny_model_dir(model, cache_root, seed)
        return _from_directory(directory, name=model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        gguf = GGUFModel(path, cache_root)
        return PreparedModel(name=gguf.name, config=gguf.config(), tensors=gguf, tokenizer_dir=gguf.tokenizer_dir,
                             sha256=gguf.sha256())
    if (path / "config.json").is_file():
        return _from_directory(path, name=path.name)
    raise ModelNotFoundError(
        f"torch backend: {model!r} is neither {' nor '.join(TINY_MODELS)}, a .gguf file, nor a transformers "
        "directory with config.json")


def _from_directory(directory: Path, *, name: str) -> PreparedModel:
    return PreparedModel(name=name, config=AutoConfig.from_pretrained(str(directory)),
                         tensors=SafetensorsSource(directory), tokenizer_dir=lambda: directory)
