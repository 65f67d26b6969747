"""The llama.cpp backend: one GGUF (a whole model or a layer-range shard) served through llama-cpp-python's C API.

One model, one context shared by every session. Each session owns a llama.cpp sequence id (its KV cells).
``n_ctx`` is per session: the backend stops any session at ``n_ctx`` positions.

Batch invariance (``LlamaCppConfig.batch_invariant``: ``request`` for the sessions whose sampling asks, or
``all``): every sequence has its own KV stream (``kv_unified = false``), so a session's cells sit where its own
history put them and its attention reads only them, and a step runs each invariant session in passes of its own
(the others share one): what a row computes in ggml's CPU kernels depends on the rows beside it in the ubatch
(``_passes``), so no other session's rows ever are, and its positions past the prompt one row per pass (``_apart``).
An invariant session's logits are then bit-identical alone or batched, in verify windows or not. Forks copy the
source's stream (``llama_memory_seq_cp`` across streams copies buffers at the start of the next decode; a KV
export or import before that runs a one-row decode of the scratch sequence first, ``_flush_copies``). Without it
(``off``), the KV cache is unified and a step is a single ``llama_decode`` over one ubatch (prefill chunks of one
session beside decode positions of others); where a session's cells land in the shared cache, and with them the
order its attention sums in, then depends on the other sessions (docs/llamacpp-backend.md).

Layer ranges: a shard GGUF (``artifacts.shard``) holds layers ``[start, end)`` renumbered from 0. The head looks
tokens up itself; every other hop is fed the previous hop's hidden states through ``llama_batch.embd``. A non-tail
hop asks for every row as an output (llama.cpp prunes the last layer to output rows) and copies its last layer's
output ``l_out-<n-1>`` out of the graph with ``ggml_capture.LayerCapture``, which also stops the graph there so the
lm_head never runs. The tail samples with each session's llama.cpp sampler chain. deepseek4 hops carry its
``hc_mult`` hyper-connection streams (``streams.StreamLayout``): the capture reads ``l_last-<n-1>`` and a later
hop, fed token id 0, has its ``hc_init`` node overwritten with them (see ``ggml_capture``).

Every public method takes ``_lock``: the node drives ``step`` from one worker thread, but a close arriving from
elsewhere must never run ``llama_memory_seq_rm`` in the middle of a decode.

Why one module of ~590 lines: one class over one llama.cpp context, whose loading, sessions, forks, batched step
and KV export/import share the same lock and C objects; the config, placement, KV cells and vocabulary live
beside it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from actors.backend import Hidden, StepInput, StepOutput, TopLogits
from actors.backends.llamacpp.batch import Batch, ubatch_order
from actors.backends.llamacpp.chat_template import ChatTemplate
from actors.backends.llamacpp.config import LlamaCppConfig
from actors.backends.llamacpp.cpu_buffers import buffer_types
from actors.backends.llamacpp.ggml_capture import LayerCapture
from actors.backends.llamacpp.kv_state import KvCells
from actors.backends.llamacpp.placement import file_sha256, place
from actors.backends.llamacpp.resident import ResidentPrefixes
from actors.backends.llamacpp.sampling import Sampler
from actors.backends.llamacpp.streams import stream_layout
from actors.backends.llamacpp.vocabulary import Vocabulary
from actors.backends.session_table import HoldsSessions, SessionTable, Wording, choice_seed
from schemas.errors import (
    BackendError,
    BadRequestError,
    CapacityError,
    ContextLengthError,
    ModelLoadError,
    SnapshotError,
)
from schemas.node import BackendInfo, LayerRange
from schemas.reasoning import ReasoningStart
from schemas.session import CONTEXT_CAP, Prompt, SamplingParams
from schemas.tools import ToolCallFormat

__all__ = ["LlamaCppBackend", "LlamaCppConfig", "ModelLoadError", "load_llamacpp"]

log = logging.getLogger(__name__)

_KV_REFRESH_S = 0.5
"""How stale ``kv_bytes_in_use`` may be."""

_WORDING = Wording(
    full="all {max} sequences of this node are in use",
    forks_full="{forks} forks need as many free sequences; {free} of {max} are free",
    step_forks_full="this step forks {forks} sessions; {free} sequences are free",
    unsampled="a session forks on the tail right after the step that sampled its first token (the forks sample "
              "theirs from the same logits)")
"""Capacity is counted in sequences here: each session holds one (``SessionTable`` counts them, ``_free_seqs``
says which)."""

_backend_ready = False
_backend_lock = threading.Lock()


@dataclasses.dataclass
class _Session:
    seq_id: int
    position: int = 0
    sampler: Sampler | None = None
    sampled_row: int = -1
    """Batch row whose logits the last sample read (the row ``last_logits`` returns)."""
    sampled_in: int = -1
    """Which decode call ``sampled_row`` belongs to (``LlamaCppBackend._decodes``)."""
    sampling: SamplingParams | None = None
    """Tail: what forks of this session sample with."""
    penalty_window: list[int] = dataclasses.field(default_factory=list)
    """Tail: the prompt's last ``penalty_last_n`` tokens, for the penalty samplers of forks."""
    logits: np.ndarray[Any, np.dtype[np.float32]] | None = None
    """Tail: a copy of the last sampled row when a later pass of the same step overwrote llama.cpp's."""
    invariant: bool = False
    """Computed in passes of its own (``_passes``): batch-invariant (issue #31)."""
    prompt_end: int = 0
    """Where its prompt ends: an invariant session's later positions are computed one row per pass."""


def _init_llama(verbose: bool) -> None:
    global _backend_ready
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True


class LlamaCppBackend(HoldsSessions[_Session]):
    """A ``Backend`` over one llama.cpp model and context. Build it with ``load_llamacpp``."""

    def __init__(self, config: LlamaCppConfig) -> None:
        _init_llama(config.verbose)
        self.config = config
        self._placement = place(config)
        self._path = self._placement.facts.path
        self._lock = threading.RLock()
        self._sessions = SessionTable[_Session]("llama.cpp", config.max_sessions, tail=self.is_tail,
                                                wording=_WORDING)
        # The last sequence id is the scratch one KV segments pass through (``kv_state.KvCells``).
        self._free_seqs = list(range(config.max_sessions - 1, -1, -1))
        self._resident = ResidentPrefixes(config.resident_prefixes)
        """Finished sessions' KV kept for prefix reuse (issue #26), under the sequence ids after the sessions'."""
        self._resident_seqs = list(range(config.n_seq_max - 2, config.max_sessions - 1, -1))
        self._kv_bytes = 0
        self._kv_refreshed = 0.0
        self._decodes = 0
        self._copies_pending = False
        """Forks queued stream copies llama.cpp has not run yet (it runs them at the start of the next decode)."""
        self._model: Any = None
        self._ctx: Any = None
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    # --- loading ----------------------------------------------------------------------------------------------

    def _load(self) -> None:
        self._cpu_buffers = buffer_types().allow_amx(self.config.allow_amx) if self.config.extra_buffers else []
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = self.config.extra_buffers
        self._model = llama_cpp.llama_model_load_from_file(str(self._path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load model file {self._path} (see its log with verbose=True)")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        facts = self._placement.facts
        self._text = Vocabulary(self._vocab, model_name=facts.name, architecture=facts.architecture,
                                chat_template=facts.chat_template, with_template=self.is_head)
        self._n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self._n_vocab = self._text.n_vocab
        self._n_ctx = min(self.config.n_ctx, int(llama_cpp.llama_model_n_ctx_train(self._model)), CONTEXT_CAP)
        self._threads = self.config.threads or os.cpu_count() or 1
        self._streams = stream_layout(facts.architecture, facts.layout.value)
        self._inject = "" if self.is_head else self._streams.input_node
        last = None if self.is_tail else int(llama_cpp.llama_model_n_layer(self._model)) - 1
        self._capture = None if last is None and not self._inject else LayerCapture(
            last, self._n_embd, native_dir=self.config.native_dir, node=self._streams.output_node,
            streams=self._streams.streams, inject=self._inject)
        self._ctx = llama_cpp.llama_init_from_model(self._model, self._context_params())
        if not self._ctx:
            raise ModelLoadError(f"llama.cpp could not create a context for {self._path} "
                                 f"({self.config.max_sessions} x {self._n_ctx} tokens)")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        n_swa = self._sliding_window()
        # llama.cpp sizes a windowed layer's stream to its window and one ubatch, in 256s (llama-kv-cache-iswa.cpp).
        swa_cells = -(-min(int(llama_cpp.llama_n_ctx_seq(self._ctx)), n_swa + self.config.n_batch) // 256) * 256
        self._kv = KvCells(self._ctx, self._memory, scratch=self.config.n_seq_max - 1, n_swa=n_swa,
                           streams=self.config.kv_streams, swa_cells=swa_cells,
                           whole_sequences=self._streams.whole_sequence_kv)
        # A hop that takes its streams through the injected node is fed token ids (see ``_fill``).
        self._batch = Batch(self.config.n_batch, 0 if self.is_head or self._inject else self._n_embd)
        self._info = self._make_info()

    def _context_params(self) -> llama_cpp.llama_context_params:
        c = self.config
        p: llama_cpp.llama_context_params = llama_cpp.llama_context_default_params()
        # Per-sequence streams split n_ctx evenly, the scratch sequence's stream included.
        p.n_ctx = self._n_ctx * (c.n_seq_max if c.kv_streams else c.max_sessions)
        p.n_batch = p.n_ubatch = c.n_batch
        p.n_seq_max = c.n_seq_max
        p.n_threads = p.n_threads_batch = self._threads
        p.kv_unified = not c.kv_streams
        # Windowed layers keep only their window per sequence: sessions never roll back, so the full-size SWA
        # cache (llama.cpp's default, for prefix reuse) would only cost memory.
        p.swa_full = False
        p.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if c.flash_attn
                             else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        # The tail needs one logits row per sampling session; a non-tail hop needs every row (its hidden states).
        # Sizing the output to that keeps a vocab-wide logits buffer per batch row (0.5 GB here) out of memory.
        # llama.cpp reserves at least one output row per sequence (the scratch one included).
        p.n_outputs_max = c.n_seq_max + c.max_sessions * c.max_draft if self.is_tail else c.n_batch
        p.no_perf = True
        if self._streams.whole_sequence_kv:
            # The V4 cache drops trailing positions only from its rollback ring (llama_kv_cache_dsv4::seq_rm): room
            # for a verify window's rejected positions (issue #20), the most a session ever gives back at once.
            p.n_rs_seq = c.max_draft + 1
        if self._capture is not None:
            self._capture.install(p)
        return p

    def _make_info(self) -> BackendInfo:
        facts = self._placement.facts
        version = llama_cpp.llama_version().decode()
        return BackendInfo(
            kind="llamacpp", model_name=facts.name, architecture=facts.architecture, file_type=facts.file_type,
            n_layers=self._placement.n_layers_total, hidden_size=self._n_embd,
            hidden_shape=self._streams.hidden_shape(self._n_embd),
            n_vocab=self._n_vocab, context_length=self._n_ctx, threads=self._threads,
            version=f"llama.cpp {version} (llama-cpp-python {llama_cpp.__version__}; CPU buffers: "
                    f"{', '.join(self._cpu_buffers) or 'plain'})",
            artifact_sha256=self.config.sha256 or file_sha256(self._path), wire_dtype="f32")

    # --- Backend properties -------------------------------------------------------------------------------------

    @property
    def info(self) -> BackendInfo:
        return self._info

    @property
    def layers(self) -> LayerRange:
        return self._placement.layers

    @property
    def is_head(self) -> bool:
        return self._placement.is_head

    @property
    def is_tail(self) -> bool:
        return self._placement.is_tail

    @property
    def max_batch_tokens(self) -> int:
        return self.config.n_batch

    @property
    def model_file(self) -> Path:
        """The file actually loaded (the cut shard when a sub-range of a whole model was asked for)."""
        return self._path

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._text.template

    # --- tokens (the head renders and tokenizes; every node turns tokens into bytes) ----------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if not self.is_head:
            raise BadRequestError("only the head node tokenizes")
        return self._text.tokenize(prompt)

    def tool_format(self) -> ToolCallFormat:
        """Head: how this model is asked to write tool calls; the node reports it in ``TokenizeReply.tool_format``
        for prompts with tools."""
        return self._text.tool_format()

    def reasoning_start(self, prompt_tokens: list[int]) -> ReasoningStart | None:
        """Head: where a reply to this prompt starts relative to a think block, when the template marks reasoning
        (``SessionOpened.reasoning``, issue #27)."""
        return self._text.reasoning_start(prompt_tokens)

    def token_bytes(self, token: int) -> bytes:
        return self._text.token_bytes(token)

    def is_end_of_generation(self, token: int) -> bool:
        return self._text.is_end_of_generation(token)

    # --- sessions -----------------------------------------------------------------------------------------------

    def open_session(self, session_id: str, *, prompt_tokens: list[int], sampling: SamplingParams) -> None:
        with self._lock:
            self._require_open()
            self._sessions.check_new(session_id)
            if len(prompt_tokens) >= self._n_ctx:
                raise ContextLengthError(f"prompt of {len(prompt_tokens)} tokens leaves no room in the "
                                         f"{self._n_ctx}-token context")
            self._sessions.check_room()
            invariant = self._invariant(sampling)
            seq_id = self._free_seqs.pop()
            # Defensive: a sequence id comes back to the pool only after its cells were removed.
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            session = _Session(seq_id, invariant=invariant, prompt_end=len(prompt_tokens))
            if self.is_tail:
                try:
                    session.sampler = Sampler(sampling, n_vocab=self._n_vocab, prompt_tokens=prompt_tokens,
                                              vocab=self._vocab)
                except BaseException:
                    self._free_seqs.append(seq_id)
                    raise
                session.sampling = sampling
                session.penalty_window = list(prompt_tokens[-sampling.penalty_last_n:]) if sampling.penalty_last_n \
                    else []
            self._sessions.add(session_id, session)

    def _invariant(self, sampling: SamplingParams) -> bool:
        """Whether a session of ``sampling`` is computed batch-invariantly; a 400 if it asks and cannot be."""
        if sampling.batch_invariant and not self.config.kv_streams:
            raise BadRequestError("batch_invariant: this node computes every session on one unified KV cache, "
                                  "where a session's numbers depend on the others; its operator enables it with "
                                  "llama_batch_invariant=request (or all)", param="batch_invariant")
        return self.config.batch_invariant == "all" or sampling.batch_invariant

    def fork_session(self, session_id: str, fork_ids: list[str]) -> list[StepOutput]:
        """n > 1: see ``actors.backend.ForkingBackend.fork_session``. The forks' sequences share the session's KV
        cells (``llama_memory_seq_cp`` on the unified cache tags the cells with the new sequence ids; nothing is
        copied) until each writes its own positions; with per-sequence streams each fork gets a copy of the
        source's stream, cell for cell, so it computes what the source would."""
        with self._lock:
            self._require_open()
            return self._fork(self._sessions[session_id], fork_ids)

    def _fork(self, source: _Session, fork_ids: Sequence[str]) -> list[StepOutput]:
        def make(choice: int) -> _Session:
            fork = _Session(self._free_seqs.pop(), position=source.position, invariant=source.invariant,
                            prompt_end=source.prompt_end)
            try:
                llama_cpp.llama_memory_seq_rm(self._memory, fork.seq_id, -1, -1)
                llama_cpp.llama_memory_seq_cp(self._memory, source.seq_id, fork.seq_id, -1, -1)
                self._copies_pending = self.config.kv_streams
                if self.is_tail:
                    assert source.sampling is not None
                    fork.sampling, fork.penalty_window = source.sampling, source.penalty_window
                    fork.sampler = Sampler(source.sampling, n_vocab=self._n_vocab, vocab=self._vocab,
                                           prompt_tokens=source.penalty_window,
                                           seed=choice_seed(source.sampling.seed, choice))
            except BaseException:
                self._free(fork)
                raise
            return fork

        def first(fork: _Session) -> StepOutput:
            assert fork.sampler is not None
            token, logprobs = fork.sampler.sample(self._ctx, source.sampled_row)
            fork.sampled_row, fork.sampled_in = source.sampled_row, self._decodes
            return StepOutput(token=token, logprobs=logprobs)

        sampled = source.sampled_row >= 0 and source.sampled_in == self._decodes
        outputs = self._sessions.fork(fork_ids, make, first, sampled=sampled, discard=self._free)
        self._refresh_kv_bytes(force=True)
        return outputs

    def close_session(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id)
            if session is None:
                return
            self._free(session)
            self._refresh_kv_bytes(force=True)

    def _free(self, session: _Session) -> None:
        """Give back a session's cells, sampler and sequence id (a session no longer, or never, in the table)."""
        if self._ctx is not None:
            llama_cpp.llama_memory_seq_rm(self._memory, session.seq_id, -1, -1)
        if session.sampler is not None:
            session.sampler.close()
        self._free_seqs.append(session.seq_id)

    def session_position(self, session_id: str) -> int:
        """Positions of ``session_id`` held in KV so far."""
        with self._lock:
            return self._sessions[session_id].position

    def kv_cells(self, session_id: str) -> tuple[int, int]:
        """(lowest, highest) position llama.cpp holds for the session's sequence; (-1, -1) when it holds none."""
        with self._lock:
            seq = self._sessions[session_id].seq_id
            return (int(llama_cpp.llama_memory_seq_pos_min(self._memory, seq)),
                    int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq)))

    def seq_cells(self, seq_id: int) -> tuple[int, int]:
        """As ``kv_cells`` for a raw sequence id (to check a closed session left nothing behind)."""
        with self._lock:
            return (int(llama_cpp.llama_memory_seq_pos_min(self._memory, seq_id)),
                    int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id)))

    def seq_id_of(self, session_id: str) -> int:
        with self._lock:
            return self._sessions[session_id].seq_id

    # --- KV in and out (issue #18 snapshots and reuse, issue #20 rollback; ``actors.backend.KvBackend``) ----------

    def _sliding_window(self) -> int:
        facts = self._placement.facts
        value = facts.layout.value(f"{facts.architecture}.attention.sliding_window", 0)
        return int(value) if isinstance(value, int) else 0

    def export_kv(self, session_id: str, start: int, end: int) -> bytes:
        with self._lock:
            self._require_open()
            session = self._sessions.exporting(session_id, start, end)
            self._flush_copies()
            if self._kv.whole_sequences:
                return self._kv.export_whole(session.seq_id, start, end, session.position)
            return self._kv.export(session.seq_id, start, end)

    def import_kv(self, session_id: str, blobs: list[bytes], end: int) -> None:
        with self._lock:
            self._require_open()
            session = self._sessions[session_id]
            before = session.position
            self._flush_copies()
            try:
                if self._kv.whole_sequences:
                    self._kv.load_whole(session.seq_id, blobs, before)
                else:
                    self._kv.load_all(session.seq_id, blobs)
                low, high = self._kv.span(session.seq_id)
                if high != end - 1:
                    raise SnapshotError(f"the KV state holds positions up to {high}, not up to {end - 1}")
            except BaseException:
                self._kv.truncate(session.seq_id, before)
                raise
            session.position = end
            self._refresh_kv_bytes(force=True)

    def truncate(self, session_id: str, position: int) -> None:
        with self._lock:
            self._require_open()
            session = self._sessions.truncating(session_id, position)
            self._kv.truncate(session.seq_id, position)
            session.position = position
            session.sampled_row = -1

    def kv_continues(self, session_id: str) -> bool:
        with self._lock:
            session = self._sessions[session_id]
            return self._kv.continues(session.seq_id, session.position)

    def replay_sampled(self, session_id: str, tokens: list[int]) -> None:
        with self._lock:
            session = self._sessions[session_id]
            if session.sampler is None or session.sampling is None:
                raise BadRequestError("only the tail samples")
            # The same seed (the one llama.cpp drew, if the session gave none): replaying the tokens then advances
            # its random state to where the sampler it replaces was (issue #31).
            sampler = Sampler(session.sampling, n_vocab=self._n_vocab, prompt_tokens=session.penalty_window,
                              vocab=self._vocab, seed=session.sampler.seed)
            session.sampler.close()
            session.sampler = sampler
            for token in tokens:
                sampler.accept(token)

    # --- resident prefixes (issue #26; ``resident``, ``actors.node.reuse.ResidentKv``) ---------------------------

    @property
    def resident_slots(self) -> int:
        """Finished sessions this context can keep parked (0: a cache that copies only whole sequences)."""
        return 0 if self._kv.whole_sequences else self._resident.slots

    def park_session(self, session_id: str, handle: str) -> bool:
        """Close the session but keep its cells under ``handle`` for prefix reuse, in a sequence of their own (the
        least recently used parked one goes if every slot is taken): on the unified cache the cells are only
        tagged with it. False, and nothing done, when this context keeps none (no slots, or a cache that copies
        only whole sequences)."""
        with self._lock:
            self._require_open()
            if self.resident_slots <= 0 or session_id not in self._sessions:
                return False
            while not self._resident_seqs:
                self._evict_parked()
            session = self._sessions.pop(session_id)
            assert session is not None
            seq = self._resident_seqs.pop()
            llama_cpp.llama_memory_seq_rm(self._memory, seq, -1, -1)
            llama_cpp.llama_memory_seq_cp(self._memory, session.seq_id, seq, -1, -1)
            self._copies_pending = self._copies_pending or self.config.kv_streams
            self._resident.park(handle, seq, session.position)
            self._free(session)
            return True

    def parked_prefixes(self) -> dict[str, int]:
        """The parked sequences still held, with the positions each holds."""
        with self._lock:
            return self._resident.positions()

    def adopt_parked(self, handle: str, session_id: str, n: int) -> None:
        """Give a just-opened session (at position 0) positions ``[0, n)`` of a parked sequence."""
        with self._lock:
            self._require_open()
            parked = self._resident.get(handle)
            session = self._sessions[session_id]
            if parked is None:
                raise SnapshotError(f"no parked prefix {handle} (evicted)")
            if session.position != 0 or not 0 < n <= parked.positions:
                raise BadRequestError(f"cannot adopt {n} positions of a parked prefix of {parked.positions} into a "
                                      f"session at {session.position}")
            if self.config.kv_streams:  # streams copy whole; the positions past n are dropped again
                llama_cpp.llama_memory_seq_cp(self._memory, parked.seq_id, session.seq_id, -1, -1)
                self._copies_pending = True  # copied at the next decode (``_flush_copies`` before KV moves)
                self._kv.truncate(session.seq_id, n)
            else:
                llama_cpp.llama_memory_seq_cp(self._memory, parked.seq_id, session.seq_id, 0, n)
            if self._kv.span(session.seq_id)[1] != n - 1:
                llama_cpp.llama_memory_seq_rm(self._memory, session.seq_id, -1, -1)
                raise SnapshotError(f"the parked prefix {handle} lacks positions below {n}")
            session.position = n

    def export_parked(self, handle: str, start: int, end: int) -> bytes:
        """``export_kv`` of a parked sequence (demoting it to host memory)."""
        with self._lock:
            self._require_open()
            parked = self._resident.get(handle)
            if parked is None or not 0 <= start < end <= parked.positions:
                raise SnapshotError(f"no parked prefix {handle} holding [{start}, {end})")
            self._flush_copies()
            return self._kv.export(parked.seq_id, start, end)

    def drop_parked(self, handle: str) -> None:
        with self._lock:
            parked = self._resident.drop(handle)
            if parked is not None:
                self._release(parked.seq_id)

    def _evict_parked(self) -> bool:
        handle = self._resident.oldest()
        if handle is None:
            return False
        parked = self._resident.drop(handle)
        assert parked is not None
        self._resident.evicted += 1
        self._release(parked.seq_id)
        return True

    def _release(self, seq_id: int) -> None:
        if self._ctx is not None:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        self._resident_seqs.append(seq_id)

    def kv_bytes_in_use(self, *, fresh: bool = False) -> int:
        """KV bytes the open sessions hold, as of the last refresh (at most ``_KV_REFRESH_S`` old). Lock-free unless
        ``fresh``: the node asks from its event loop (heartbeats, metrics), which must never wait for a decode."""
        if fresh:
            with self._lock:
                self._refresh_kv_bytes(force=True)
        return self._kv_bytes

    def _refresh_kv_bytes(self, force: bool = False) -> None:
        # Measuring walks the sequence's cells (~150 us per session): often enough for heartbeats, rarely enough to
        # stay out of the decode loop's way.
        now = time.monotonic()
        if not force and now - self._kv_refreshed < _KV_REFRESH_S:
            return
        self._kv_refreshed = now
        self._kv_bytes = sum(int(llama_cpp.llama_state_seq_get_size(self._ctx, s.seq_id))
                             for s in self._sessions.values() if s.position) if self._ctx is not None else 0

    def _require_open(self) -> None:
        if self._ctx is None:
            raise BackendError("the llama.cpp backend is closed")

    # --- the forward pass ---------------------------------------------------------------------------------------

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        with self._lock:
            self._require_open()
            sessions = self._check(batch)
            passes = self._passes(batch, sessions)
            parts: list[list[StepOutput]] = [[] for _ in batch]
            started: dict[int, int] = {}
            try:
                for n, group in enumerate(passes):
                    for i, _ in group:
                        started.setdefault(i, batch[i].start_position)
                    outputs = self._pass([item for _, item in group], [sessions[i] for i, _ in group],
                                         keep_logits=n < len(passes) - 1)
                    for (i, _), output in zip(group, outputs, strict=True):
                        parts[i].append(output)
            except BaseException:
                # A later pass failed: the step fails whole, so the passes that ran give their positions back.
                for i, position in started.items():
                    session = sessions[i]
                    llama_cpp.llama_memory_seq_rm(self._memory, session.seq_id, position, -1)
                    session.position, session.sampled_row, session.logits = position, -1, None
                raise
            self._refresh_kv_bytes()
            return [_joined(p) for p in parts]

    def _passes(self, batch: list[StepInput], sessions: list[_Session]) -> list[list[tuple[int, StepInput]]]:
        """The step's items (with their indices) by ``llama_decode`` call: the sessions that are not invariant
        all in one, and each invariant session's in passes of its own (``_apart``). Sharing a ubatch changes a
        row's numbers even with per-sequence streams: CPU_REPACK multiplies 4-row blocks with a gemm and the rest
        with a gemv, which round differently, and without it a session's logits still moved (by up to 0.84) when
        three other streams' rows shared its pass (measured; docs/llamacpp-backend.md, "Batch invariance").
        deepseek4 also decodes one sequence per pass: its captured and injected stream rows must stay in batch
        order (``streams``)."""
        shared = [(i, item) for i, (item, s) in enumerate(zip(batch, sessions, strict=True)) if not s.invariant]
        passes = [[one] for one in shared] if self._streams.one_sequence_per_decode else [shared] if shared else []
        for i, (item, session) in enumerate(zip(batch, sessions, strict=True)):
            if session.invariant:
                passes += [[(i, part)] for part in _apart(item, session.prompt_end)]
        return passes

    def _pass(self, batch: list[StepInput], sessions: list[_Session], *, keep_logits: bool) -> list[StepOutput]:
        """One ``llama_decode`` of ``batch``; ``keep_logits``: another pass of the step follows, so sampled rows are
        copied (``last_logits``)."""
        spans = self._fill(batch, sessions)
        if self._capture is not None and self._capture.copies_out:
            self._capture.arm(self._batch.n)
        rc = llama_cpp.llama_decode(self._ctx, self._batch.struct())
        while rc == 1 and self._evict_parked():  # no room: kept prefixes go, never a running session's KV
            if self._capture is not None and self._capture.copies_out:
                self._capture.arm(self._batch.n)
            rc = llama_cpp.llama_decode(self._ctx, self._batch.struct())
        self._decodes += 1
        if rc != 0:
            self._after_failed_decode(rc, sessions, batch)
        if self._inject:
            assert self._capture is not None
            self._capture.fed()
        self._copies_pending = False
        outputs = self._collect(batch, sessions, spans)
        for item, session in zip(batch, sessions, strict=True):
            session.position = item.start_position + item.n_positions
            if keep_logits and session.sampled_row >= 0:
                session.logits = self._rows(session.sampled_row, session.sampled_row + 1)[0]
        for item, session, output in zip(batch, sessions, outputs, strict=True):
            if item.forks:
                output.forks = self._fork(session, item.forks)
        return outputs

    def _flush_copies(self) -> None:
        """Run the stream copies forks queued, before KV state is read or written: llama.cpp runs them only at the
        start of a decode, so one row of the (empty) scratch sequence is decoded and dropped again."""
        if not self._copies_pending:
            return
        scratch = self.config.n_seq_max - 1
        self._batch.clear()
        hidden = None if self.is_head else np.zeros((1, self._n_embd), dtype=np.float32)
        self._batch.add(scratch, 0, tokens=[0] if self.is_head else None, hidden=hidden,
                        output="all" if self._capture is not None else "none")
        if self._capture is not None:
            self._capture.arm(1)
        rc = llama_cpp.llama_decode(self._ctx, self._batch.struct())
        self._decodes += 1
        if self._capture is not None and rc == 0:
            self._capture.take()
        llama_cpp.llama_memory_seq_rm(self._memory, scratch, -1, -1)
        if rc != 0:
            raise BackendError(f"llama_decode failed with status {rc} applying the forks' KV copies")
        self._copies_pending = False

    def _check(self, batch: list[StepInput]) -> list[_Session]:
        if not batch:
            raise BadRequestError("empty step")
        sessions = [self._sessions[item.session_id] for item in batch]
        if len({id(s) for s in sessions}) != len(sessions):
            raise BadRequestError("a step may carry each session at most once")
        total = 0
        for item, session in zip(batch, sessions, strict=True):
            if (item.tokens is None) == self.is_head or (item.hidden is None) != self.is_head:
                kind = "token ids" if self.is_head else "hidden states"
                raise BadRequestError(f"this node takes {kind} (layers {self.layers})")
            n = item.n_positions
            total += n
            if item.start_position != session.position:
                raise BadRequestError(f"session {item.session_id}: step starts at position {item.start_position}, "
                                      f"the node holds {session.position}")
            if item.start_position + n > self._n_ctx:
                raise ContextLengthError(f"session {item.session_id} would exceed its {self._n_ctx}-token context")
            if item.tokens is not None and any(not 0 <= t < self._n_vocab for t in item.tokens):
                raise BadRequestError(f"token id outside the vocabulary (0..{self._n_vocab - 1})")
        if total > self.config.n_batch:
            raise BadRequestError(f"step carries {total} positions, more than {self.config.n_batch}")
        forks = [f for item in batch for f in item.forks]
        if forks:
            self._sessions.check_step_forks(forks)
        if any(item.rows for item in batch) and not self.is_tail:
            raise BadRequestError("only the tail returns logits rows")
        if self.is_tail and any(item.forks and not item.sample for item in batch):
            raise BadRequestError("on the tail, a step that forks must sample (the forks sample from its logits)")
        return sessions

    def _fill(self, batch: list[StepInput], sessions: list[_Session]) -> list[tuple[int, int]]:
        self._batch.clear()
        spans = []
        fed = []
        for item, session in zip(batch, sessions, strict=True):
            # Non-tail hops hand on every row's hidden state; the tail needs logits only where it samples.
            output = "all" if not self.is_tail or item.rows else ("last" if item.sample else "none")
            hidden = None if item.hidden is None else np.asarray(item.hidden, dtype=np.float32)
            tokens = item.tokens
            if self._inject and hidden is not None:
                fed.append(self._stream_rows(hidden))
                tokens, hidden = [0] * fed[-1].shape[0], None
            spans.append(self._batch.add(session.seq_id, item.start_position, tokens=tokens, hidden=hidden,
                                         output=output))
        if fed:
            assert self._capture is not None
            self._capture.feed(np.concatenate(fed) if len(fed) > 1 else fed[0])
        return spans

    def _stream_rows(self, hidden: Hidden) -> Hidden:
        row = self._streams.streams * self._n_embd
        if hidden.ndim < 1 or hidden.shape[0] == 0 or hidden.size != hidden.shape[0] * row:
            raise BadRequestError(f"hidden states of shape {hidden.shape} do not have {self._streams.streams} x "
                                  f"{self._n_embd} values per row")
        return hidden.reshape(hidden.shape[0], row)

    def _after_failed_decode(self, rc: int, sessions: list[_Session], batch: list[StepInput]) -> None:
        # llama.cpp rolls back what the failed call wrote; cells past each session's position are dropped here
        # too so that a retry starts from a clean sequence.
        for session in sessions:
            llama_cpp.llama_memory_seq_rm(self._memory, session.seq_id, session.position, -1)
        ids = ", ".join(item.session_id for item in batch)
        if rc == 1:
            raise CapacityError(f"llama.cpp found no KV room for this step (sessions {ids})")
        raise BackendError(f"llama_decode failed with status {rc} (sessions {ids})")

    def _collect(self, batch: list[StepInput], sessions: list[_Session],
                 spans: list[tuple[int, int]]) -> list[StepOutput]:
        if self._capture is not None and self._capture.copies_out:
            hidden: Hidden = self._capture.take()
            if self.config.kv_streams and len(batch) > 1:
                # llama.cpp split the batch "equally" per stream; the capture has the rows in ubatch order.
                order = ubatch_order([(s.seq_id, item.n_positions) for item, s in zip(batch, sessions, strict=True)],
                                     self.config.n_batch)
                hidden = hidden[np.argsort(order)]
            shape = tuple(self._info.hidden_shape)
            return [StepOutput(hidden=hidden[lo:hi].reshape(hi - lo, *shape)) for lo, hi in spans]
        outputs = []
        for item, session, (lo, hi) in zip(batch, sessions, spans, strict=True):
            token, logprobs = None, None
            session.sampled_row, session.logits = -1, None
            if item.rows:
                outputs.append(StepOutput(rows=self._rows(lo, hi)))
                continue
            top = None
            if item.sample:
                assert session.sampler is not None
                if item.top_k:  # before sampling: the raw logits, whatever the sampler does with them
                    top = TopLogits.of(self._rows(hi - 1, hi)[0], item.top_k)
                token, logprobs = session.sampler.sample(self._ctx, hi - 1)
                session.sampled_row, session.sampled_in = hi - 1, self._decodes
            outputs.append(StepOutput(token=token, logprobs=logprobs, top=top))
        return outputs

    def _rows(self, lo: int, hi: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        """A copy of the logits of batch rows ``[lo, hi)`` (a verify window's every position)."""
        out = np.empty((hi - lo, self._n_vocab), dtype=np.float32)
        for i, row in enumerate(range(lo, hi)):
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
            if not ptr:
                raise BackendError(f"no logits for batch row {row}")
            out[i] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        return out

    def last_logits(self, session_id: str) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The logits the session's last sample was drawn from (a copy; valid until the next step). Tail only:
        for diagnostics and tests that need to tell a near-tie from a real divergence."""
        with self._lock:
            session = self._sessions[session_id]
            if session.logits is not None:
                return session.logits.copy()
            row = session.sampled_row
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, row) if row >= 0 else None
            if not ptr:
                raise BadRequestError(f"session {session_id} sampled nothing in the last step")
            return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()

    # --- teardown -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            for session in self._sessions.values():
                if session.sampler is not None:
                    session.sampler.close()
            self._sessions.clear()
            if self._ctx is not None:
                llama_cpp.llama_free(self._ctx)
                self._ctx = None
            if self._model is not None:
                llama_cpp.llama_model_free(self._model)
                self._model = None


def _apart(item: StepInput, prompt_end: int) -> list[StepInput]:
    """An invariant session's item as passes: its prompt positions together (a prefill chunk, whose size no load
    changes), each later position alone. Within one sequence a pass of k rows rounds differently from k passes of
    one (ggml takes another attention kernel for a single query row), and plain decoding computes one row per pass:
    so a verify window (issue #20) or a replayed frame (a repair) computes exactly what plain decoding did."""
    n = item.n_positions
    cut = min(max(prompt_end - item.start_position, 0), n)
    spans = ([(0, cut)] if cut else []) + [(k, k + 1) for k in range(cut, n)]
    if len(spans) == 1:
        return [item]
    return [StepInput(item.session_id, item.start_position + lo,
                      tokens=None if item.tokens is None else item.tokens[lo:hi],
                      hidden=None if item.hidden is None else item.hidden[lo:hi],
                      sample=item.sample and hi == n, rows=item.rows, top_k=item.top_k if hi == n else 0,
                      forks=item.forks if hi == n else ())
            for lo, hi in spans]


def _joined(parts: list[StepOutput]) -> StepOutput:
    """One item's output from those of the passes it was cut into (``_apart``), in order."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    hidden = [p.hidden for p in parts if p.hidden is not None]
    rows = [p.rows for p in parts if p.rows is not None]
    return StepOutput(hidden=np.concatenate(hidden) if hidden else None, token=last.token, logprobs=last.logprobs,
                      rows=np.concatenate(rows) if rows else None, top=last.top, forks=last.forks)


def load_llamacpp(**options: Any) -> LlamaCppBackend:
    """``load_backend("llamacpp", ...)``: options are ``LlamaCppConfig`` fields (``model_path``, ``n_ctx``,
    ``max_sessions``, ``threads``, ``n_batch``, ``layer_start``, ``layer_end``, ...)."""
    try:
        config = LlamaCppConfig(**options)
    except TypeError as e:
        raise ValueError(f"bad llamacpp backend options: {e}") from e
    return LlamaCppBackend(config)
