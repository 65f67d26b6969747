"""Feed hidden states to a shard GGUF that does not start at layer 0 (run in a subprocess: the point is to see
whether llama.cpp aborts). ``python -m tests.support.embd_probe SHARD``; prints ``survived`` when it does not."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def main(shard: Path) -> None:
    from actors.backend import StepInput
    from actors.backends import load_backend
    from schemas.session import SamplingParams
    backend = load_backend("llamacpp", model_path=shard, n_ctx=64, max_sessions=1, threads=1)
    assert not backend.is_head
    n_embd = backend.info.hidden_size
    backend.open_session("p", prompt_tokens=[1, 2, 3, 4], sampling=SamplingParams(temperature=0.0))
    hidden = np.random.default_rng(0).standard_normal((4, n_embd)).astype(np.float32)
    backend.step([StepInput("p", 0, hidden=hidden, sample=backend.is_tail)])
    print("survived", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
