"""A reusable ``llama_batch`` whose arrays are numpy-owned, so a step fills it with slice assignments.

``llama_batch_init`` allocates one small array per row for sequence ids, which leaves Python a per-row loop of
ctypes stores (~1 us each) for every step. Here every column is one contiguous numpy array and ``seq_id`` points
each row at its own slot of one int32 array, so filling a 512-token prefill chunk is a handful of vectorized
copies. llama.cpp only reads the arrays during ``llama_decode``; the struct is rebuilt by value for each call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp
import numpy as np
import numpy.typing as npt

from schemas.errors import BadRequestError


def _ptr(array: npt.NDArray[np.generic], ctype: type[ctypes._SimpleCData]) -> ctypes._Pointer:  # type: ignore[type-arg]
    return ctypes.cast(array.ctypes.data, ctypes.POINTER(ctype))


class Batch:
    """Room for ``capacity`` rows of token ids (``n_embd == 0``) or of ``n_embd``-float embeddings."""

    def __init__(self, capacity: int, n_embd: int = 0) -> None:
        if capacity <= 0:
            raise ValueError(f"batch capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.n_embd = n_embd
        self.n = 0
        self.token = np.zeros(capacity, dtype=np.int32)
        self.embd = np.zeros((capacity, max(n_embd, 1)), dtype=np.float32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.output = np.zeros(capacity, dtype=np.int8)
        self._n_seq_id = np.ones(capacity, dtype=np.int32)
        self._seq_rows = (ctypes.POINTER(llama_cpp.llama_seq_id) * (capacity + 1))()
        base = self.seq.ctypes.data
        for i in range(capacity):
            self._seq_rows[i] = ctypes.cast(base + 4 * i, ctypes.POINTER(llama_cpp.llama_seq_id))

    @property
    def takes_embeddings(self) -> bool:
        return self.n_embd > 0

    def clear(self) -> None:
        self.n = 0

    def add(self, seq_id: int, start_position: int, *, tokens: list[int] | None = None,
            hidden: npt.NDArray[np.float32] | None = None, output: str = "last") -> tuple[int, int]:
        """Append one session's rows; ``output`` is ``none``, ``last`` or ``all``. Returns the row span."""
        rows = self._rows(tokens, hidden)
        lo, hi = self.n, self.n + rows
        if hi > self.capacity:
            raise BadRequestError(f"step carries more than {self.capacity} positions")
        if tokens is not None:
            self.token[lo:hi] = tokens
        else:
            assert hidden is not None
            self.embd[lo:hi] = hidden.reshape(rows, self.n_embd)
        self.pos[lo:hi] = np.arange(start_position, start_position + rows, dtype=np.int32)
        self.seq[lo:hi] = seq_id
        self.output[lo:hi] = 1 if output == "all" else 0
        if output == "last":
            self.output[hi - 1] = 1
        self.n = hi
        return lo, hi

    def _rows(self, tokens: list[int] | None, hidden: npt.NDArray[np.float32] | None) -> int:
        if self.takes_embeddings:
            if hidden is None or tokens is not None:
                raise BadRequestError("this node takes hidden states, not token ids")
            if hidden.ndim < 1 or hidden.size != hidden.shape[0] * self.n_embd:
                raise BadRequestError(f"hidden states of shape {hidden.shape} do not have {self.n_embd} per row")
            rows = int(hidden.shape[0])
        else:
            if tokens is None or hidden is not None:
                raise BadRequestError("this node takes token ids, not hidden states")
            rows = len(tokens)
        if rows == 0:
            raise BadRequestError("a step item must carry at least one position")
        return rows

    def struct(self) -> llama_cpp.llama_batch:
        """The ``llama_batch`` for the rows added since ``clear``; valid while this object lives and is unchanged."""
        token = None if self.takes_embeddings else _ptr(self.token, llama_cpp.llama_token)
        embd = _ptr(self.embd, ctypes.c_float) if self.takes_embeddings else None
        seq_id = ctypes.cast(self._seq_rows, ctypes.POINTER(ctypes.POINTER(llama_cpp.llama_seq_id)))
        return llama_cpp.llama_batch(self.n, token, embd, _ptr(self.pos, llama_cpp.llama_pos),
                                     _ptr(self._n_seq_id, ctypes.c_int32), seq_id, _ptr(self.output, ctypes.c_int8))


def ubatch_order(items: Sequence[tuple[int, int]], n_ubatch: int) -> list[int]:
    """The batch rows, in the order llama.cpp computes them, of a batch of ``items`` (sequence id, rows; each item a
    distinct sequence, its rows together) on a context with one KV stream per sequence. llama.cpp then splits a
    batch "equally" and sequentially (``llama_batch_allocr::split_equal(n_ubatch, true, 0)``): a ubatch takes the
    unfinished items in batch order whose sequence ids run on by one from the first, the same number of rows of
    each (as many as all have, at most ``n_ubatch`` over all), item by item; the next ubatch takes what is left.
    A layer capture appends its rows ubatch by ubatch, so this is the order they arrive in."""
    starts = [0] * len(items)
    for i in range(1, len(items)):
        starts[i] = starts[i - 1] + items[i - 1][1]
    taken = [0] * len(items)
    order: list[int] = []
    while True:
        chosen: list[int] = []
        for i, (seq, rows) in enumerate(items):
            if taken[i] < rows and (not chosen or seq == items[chosen[-1]][0] + 1):
                chosen.append(i)
        if not chosen:
            return order
        each = min(min(items[i][1] - taken[i] for i in chosen), max(1, n_ubatch // len(chosen)))
        for i in chosen:
            order += range(starts[i] + taken[i], starts[i] + taken[i] + each)
            taken[i] += each
