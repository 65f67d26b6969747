"""Helpers for torch backend tests: backends chained in-process the way nodes chain them, and references."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from actors.backend import StepInput
from actors.backends.torch.backend import TorchBackend, TorchConfig, load_torch
from actors.backends.torch.models import tiny_model_dir
from actors.backends.torch.tokens import TokenCodec
from bus import frame as frames
from schemas.frame import FrameHeader, FrameKind, WireDType
from schemas.session import SamplingParams

LONG_PROMPT = "The quick brown fox jumps over the lazy dog; then it naps under a tree by the river bank."
GREEDY = SamplingParams(temperature=0.0)


def cache_root() -> Path:
    root = TorchConfig().cache_dir
    assert root is not None
    return root


def reference(model: str) -> PreTrainedModel:
    """The whole tiny model in one process, from the same files the nodes read."""
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir(model, cache_root())), dtype=torch.float32)
    return ref.eval()


def build_route(model: str, bounds: tuple[int, ...], **options: object) -> list[TorchBackend]:
    return [load_torch(model=model, layer_start=a, layer_end=b, **options) for a, b in itertools.pairwise(bounds)]


class WireRoute:
    """Backends chained the way nodes chain them: hidden states cross each hop as an encoded frame."""

    def __init__(self, backends: list[TorchBackend]) -> None:
        self.backends = backends
        self.hop_outputs: dict[str, list[list[np.ndarray]]] = {}
        self.wire_bytes: dict[str, list[list[int]]] = {}

    def open(self, prompt_ids: list[int], sampling: SamplingParams = GREEDY) -> str:
        sid = uuid.uuid4().hex
        for b in reversed(self.backends):  # tail first, as the gateway does
            b.open_session(sid, prompt_tokens=prompt_ids, sampling=sampling)
        self.hop_outputs[sid] = [[] for _ in self.backends[:-1]]
        self.wire_bytes[sid] = [[] for _ in self.backends[:-1]]
        return sid

    def step(self, items: list[tuple[str, int, list[int], bool]]) -> list[int | None]:
        """One pass of ``(session, start, tokens, sample)`` items through every hop, batched per hop."""
        batch = [StepInput(sid, start, tokens=list(tokens), sample=sample) for sid, start, tokens, sample in items]
        for hop, backend in enumerate(self.backends):
            outputs = backend.step(batch)
            if hop == len(self.backends) - 1:
                return [o.token for o in outputs]
            nxt = []
            for item, out in zip(batch, outputs, strict=True):
                assert out.hidden is not None
                self.hop_outputs[item.session_id][hop].append(out.hidden.copy())
                kind = FrameKind.DECODE if item.sample and item.n_positions == 1 else FrameKind.PREFILL
                header = FrameHeader(session_id=frames.session_bytes(item.session_id), kind=kind,
                                     dtype=WireDType.F32, start_position=item.start_position,
                                     n_positions=item.n_positions, position_shape=tuple(out.hidden.shape[1:]),
                                     sample=item.sample)
                wire = frames.encode(header, out.hidden)
                self.wire_bytes[item.session_id][hop].append(len(wire))
                _, hidden = frames.decode(wire)
                nxt.append(StepInput(item.session_id, item.start_position, hidden=hidden, sample=item.sample))
            batch = nxt
        raise AssertionError("unreachable")

    def prefill(self, sid: str, ids: list[int], chunk: int) -> int:
        token = None
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            token = self.step([(sid, start, piece, start + chunk >= len(ids))])[0]
        assert token is not None
        return token

    def generate(self, ids: list[int], n_tokens: int, *, chunk: int = 7,
                 sampling: SamplingParams = GREEDY) -> tuple[str, list[int]]:
        sid = self.open(ids, sampling)
        tokens = [self.prefill(sid, ids, chunk)]
        while len(tokens) < n_tokens:
            token = self.step([(sid, len(ids) + len(tokens) - 1, [tokens[-1]], True)])[0]
            assert token is not None
            tokens.append(token)
        return sid, tokens


def generate_reference(ref: PreTrainedModel, ids: list[int], n_tokens: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n_tokens, do_sample=False)
    return [int(t) for t in out[0, len(ids):]]


def whole_gguf_model(gguf_path: Path) -> PreTrainedModel:
    """The float32 weights every route node reads (the per-part cache), as one transformers model in one process."""
    from actors.backends.torch.gguf import GGUFModel

    source = GGUFModel(gguf_path, cache_root())
    config = source.config()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    names = [n for n in model.state_dict() if n != "lm_head.weight" or not config.tie_word_embeddings]
    missing, unexpected = model.load_state_dict(source.read(names), strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise RuntimeError(f"whole model: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("whole model: the LM head is not tied to the embeddings")
    return model.eval()


def expected_text(codec: TokenCodec, tokens: list[int]) -> str:
    """What a client should read for ``tokens``: their bytes up to the first end-of-generation token, as UTF-8."""
    cut = next((i for i, t in enumerate(tokens) if codec.is_end_of_generation(t)), len(tokens))
    return b"".join(codec.token_bytes(t) for t in tokens[:cut]).decode("utf-8", errors="replace")
