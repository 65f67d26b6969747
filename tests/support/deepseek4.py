"""Running the tiny and the real-width DeepSeek V4 (``artifacts.synthetic.matrix``): whole, as backend chains and as
routes, with a prompt long enough for every V4 cache to matter.

The prompt is 318 tokens of the synthetic vocabulary: past the 128-position sliding window, and past two 128-token
HCA blocks (positions 0-127 and 128-255 are compressed during prefill) and 79 CSA blocks of 4. A route prefills it
in one step (the harness's prefill chunk is 512), as the reference does.
"""

from __future__ import annotations

from pathlib import Path

from actors.backend import StepInput, StepOutput
from actors.backends import load_backend
from actors.backends.llamacpp.backend import LlamaCppBackend
from actors.selfcheck import WARM_UP_SESSION
from artifacts.synthetic.matrix import Bounds, ranges
from schemas.session import Prompt
from tests.support.arch_matrix import RecordingBackend

N_CTX = 1024
PREFILL_CHUNK = 512
PROMPT = ("The lighthouse keeper returned to the island every spring, and the fishermen came from the north with "
          "stories of strange lights seen over the water at night. ") * 2
HCA_RATIO = 128
WINDOW = 128


def open_hop(path: Path, shard_dir: Path, start: int | None = None, end: int | None = None, *, threads: int = 1,
             n_ctx: int = N_CTX, max_sessions: int = 1) -> LlamaCppBackend:
    b = load_backend("llamacpp", model_path=path, n_ctx=n_ctx, max_sessions=max_sessions, threads=threads,
                     layer_start=start, layer_end=end, shard_dir=shard_dir, n_batch=PREFILL_CHUNK)
    assert isinstance(b, LlamaCppBackend)
    return b


def open_hops(path: Path, shard_dir: Path, bounds: Bounds, **options: int) -> list[LlamaCppBackend]:
    hops: list[LlamaCppBackend] = []
    try:
        for a, b in ranges(bounds):
            hops.append(open_hop(path, shard_dir, a, b, **options))
    except BaseException:
        for h in hops:
            h.close()
        raise
    return hops


def close_all(hops: list[LlamaCppBackend]) -> None:
    for h in hops:
        h.close()


def prompt_tokens(head: LlamaCppBackend) -> list[int]:
    return head.tokenize(Prompt(text=PROMPT))


class PayloadRecorder(RecordingBackend):
    """The tail of a route, recording besides its picks the hidden-state payload it was handed: the frames' decoded
    arrays (f32 on the wire is f32 here, byte for byte), per position."""

    def __init__(self, inner: LlamaCppBackend) -> None:
        super().__init__(inner)
        self.positions = 0
        self.payload_bytes = 0
        self.shapes: set[tuple[int, ...]] = set()

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        for item in batch:
            if item.hidden is not None and item.session_id != WARM_UP_SESSION:
                self.positions += item.n_positions
                self.payload_bytes += item.hidden.nbytes
                self.shapes.add(tuple(item.hidden.shape[1:]))
        return super().step(batch)
