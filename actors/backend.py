"""The contract between a node and its model backend (stub, llamacpp, torch).

A backend owns one contiguous layer range of one model and the Hot KV State of every session on it. The node
calls ``step`` from a single worker thread with a *batch* of work items from different sessions (continuous
batching): prefill chunks and one-position decode steps mixed. Everything else (HTTP, ordering, sampling policy
of when to stop, detokenization into UTF-8 text) is the node's job, not the backend's.

What every backend keeps about its sessions (the table of them, capacity, refusals, forks) is shared:
``actors.backends.session_table``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from schemas.node import BackendInfo, LayerRange
from schemas.session import Prompt, SamplingParams, TokenLogprobs

Hidden = npt.NDArray[np.float32]
"""Hidden states of ``n`` positions: shape ``(n, *hidden_shape)``, float32."""


@dataclasses.dataclass(frozen=True, slots=True)
class TopLogits:
    """The largest logits of one row, largest first: what a tail's spot-check receipt keeps (issue #28)."""

    ids: npt.NDArray[np.int32]
    values: npt.NDArray[np.float32]

    @classmethod
    def of(cls, logits: npt.NDArray[np.floating], k: int) -> TopLogits:
        """The ``k`` largest of a row of logits (ties broken by the lower id, so that equal rows give equal
        answers)."""
        row = np.asarray(logits, dtype=np.float32).reshape(-1)
        k = min(k, row.shape[0])
        part = np.argpartition(-row, k - 1)[:k]
        order = np.lexsort((part, -row[part]))
        ids = part[order].astype(np.int32)
        return cls(ids=ids, values=row[ids].copy())


@dataclasses.dataclass(slots=True)
class StepInput:
    """One session's share of a batched forward pass through this node's layers."""

    session_id: str
    start_position: int
    tokens: list[int] | None = None
    """Token ids, on the head only."""
    hidden: Hidden | None = None
    """Incoming hidden states, on every hop but the head."""
    sample: bool = False
    """On the tail: sample a token after the last position (last prefill chunk, every decode step)."""
    rows: bool = False
    """On the tail: return the logits of every position (a verify window, issue #20) instead of sampling."""
    top_k: int = 0
    """On the tail, with ``sample``: also return the ``top_k`` largest logits of the sampled row (``StepOutput.top``:
    a spot-check receipt of the tail's work, issue #28)."""
    forks: tuple[str, ...] = ()
    """n > 1, on the last prefill chunk: after this step, fork the session into these new sessions (choices
    1..n-1; see ``ForkingBackend.fork_session``). Done inside the step, so nothing runs between the forward pass and
    the forks' first samples. Their outputs are in ``StepOutput.forks``."""

    @property
    def n_positions(self) -> int:
        if self.tokens is not None:
            return len(self.tokens)
        assert self.hidden is not None
        return int(self.hidden.shape[0])


@dataclasses.dataclass(slots=True)
class StepOutput:
    hidden: Hidden | None = None
    """Hidden states after this node's last layer (every hop but the tail)."""
    token: int | None = None
    """The sampled token (tail, when asked)."""
    logprobs: TokenLogprobs | None = None
    """The sampled token's logprobs (tail, when the session's ``SamplingParams.logprobs`` asked for them)."""
    rows: npt.NDArray[np.float32] | None = None
    """The logits of every position (tail, when ``StepInput.rows``): shape ``(n_positions, n_vocab)``, a copy."""
    top: TopLogits | None = None
    """The ``StepInput.top_k`` largest logits the token was sampled from (tail, when asked)."""
    forks: list[StepOutput] = dataclasses.field(default_factory=list)
    """One output per ``StepInput.forks`` entry, in order (the forks' first tokens on the tail)."""


@runtime_checkable
class Backend(Protocol):
    """A model shard. Methods other than ``info``-like properties are called from the node's worker thread."""

    @property
    def info(self) -> BackendInfo: ...

    @property
    def layers(self) -> LayerRange: ...

    @property
    def is_head(self) -> bool: ...

    @property
    def is_tail(self) -> bool: ...

    @property
    def max_sessions(self) -> int:
        """How many sessions may hold KV at once."""
        ...

    @property
    def max_batch_tokens(self) -> int:
        """Most positions one ``step`` call may carry across all sessions."""
        ...

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Head only: apply the chat template (for messages) and tokenize. Raises ``BadRequestError``."""
        ...

    def open_session(self, session_id: str, *, prompt_tokens: list[int], sampling: SamplingParams) -> None:
        """Reserve a KV slot; on the tail also set up the sampler (penalties see the prompt tokens)."""
        ...

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        """One forward pass over this node's layers for every item, appending each position to its session's KV."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """Tail: the raw bytes a token stands for (may be part of a UTF-8 character)."""
        ...

    def is_end_of_generation(self, token: int) -> bool:
        """Tail: EOS / end-of-turn."""
        ...

    def close_session(self, session_id: str) -> None:
        """Free the session's KV. Must be idempotent."""
        ...

    def kv_bytes_in_use(self) -> int: ...

    def close(self) -> None:
        """Release the model. Idempotent."""
        ...


@runtime_checkable
class ForkingBackend(Backend, Protocol):
    """A backend that serves n > 1 choices from one prefill (every backend of this repository)."""

    def fork_session(self, session_id: str, fork_ids: list[str]) -> list[StepOutput]:
        """Copy ``session_id``'s KV into new sessions ``fork_ids`` (choices 1, 2, ... of the session, which is
        choice 0), each at the session's position, so they decode on from the prompt without prefilling it again.

        On the tail each fork gets its own sampler (and grammar) from the session's ``SamplingParams``, seeded
        with ``seed + i`` for choice ``i`` (no seed: each draws its own), and samples its first token from the
        logits the session's last step sampled from, which must be the backend's latest step: the forks'
        first tokens come back, one ``StepOutput`` per fork. Elsewhere the outputs are empty.

        All or nothing: ``CapacityError`` when fewer sequences are free than forks asked for, ``BadRequestError``
        for a fork id already open. Forks are ordinary sessions afterwards: stepped in batches with any others and
        closed one by one."""
        ...


@runtime_checkable
class KvBackend(Backend, Protocol):
    """A backend whose sessions' KV can leave and re-enter it (issue #18: snapshots, repair, prefix reuse; issue
    #20: dropping rejected draft positions). Every backend of this repository is one.

    Blobs are opaque to the node: only a backend of the same model and layer range reads them, and whoever
    stores or moves them checks them by hash (``actors.node.recovery.snapshots``)."""

    def export_kv(self, session_id: str, start: int, end: int) -> bytes:
        """This node's KV of positions ``[start, end)`` of a session (``end`` at most its position)."""
        ...

    def import_kv(self, session_id: str, blobs: list[bytes], end: int) -> None:
        """Append the positions of ``blobs`` (exports of consecutive ranges, the first starting at the session's
        position) to an open session, which is then at ``end``. ``SnapshotError`` if a blob is not this model's
        and range's, or does not end at ``end``."""
        ...

    def truncate(self, session_id: str, position: int) -> None:
        """Drop the session's positions from ``position`` on (``position`` at most its position)."""
        ...

    def kv_continues(self, session_id: str) -> bool:
        """Whether the session's KV holds everything its next position attends to: windowed layers may have let
        older positions go, so KV imported for a prefix shorter than the exported session can lack some."""
        ...

    def replay_sampled(self, session_id: str, tokens: list[int]) -> None:
        """Tail: start the session's sampler over as it was at open, then let it accept ``tokens`` as if it had
        sampled them (penalty window, grammar): for a session rebuilt from a snapshot, or cut back by a repair."""
        ...
