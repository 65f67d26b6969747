"""Where the head's draft tokens come from (issue #20), behind one interface.

* ``NgramDraft`` (prompt lookup): the longest recent n-gram of the session's tokens that occurred before proposes
  what followed it then. No extra model; it pays on repetitive text (editing a given file, summarising a given
  text, code) and proposes nothing on free-form text, where the window sizer then turns speculation off.
* ``ModelDraft``: a small GGUF with the model's vocabulary (``--draft-model``), run greedily on the head's machine on
  a worker thread of its own: each window it catches up on the tokens accepted since, then proposes ``k`` more.
* The model's own MTP layers (DeepSeek/GLM ``nextn_predict_layers``) need the last layer's hidden state, which only
  the tail has, and the token embeddings, which only the head has; llama.cpp loads them but offers no public call to
  run them (docs/llama-cpp-layer-api.md, "MTP heads"). Where they would run and why is written up there; no MTP
  source is offered until llama.cpp has that call.

Drafts are point masses (``speculation.verify`` without ``draft_dists``): the acceptance rule then keeps the target
distribution exactly whatever the drafts are, and a draft model's own distribution is not needed on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Protocol

from actors.backend import Backend, KvBackend, StepInput
from actors.node.engine import StepEngine
from actors.node.prefix_cache import common_prefix
from schemas.session import SamplingParams


class DraftSource(Protocol):
    name: str

    async def propose(self, history: Sequence[int], k: int) -> list[int]:
        """At most ``k`` tokens the model is likely to generate after ``history`` (the prompt, every accepted
        token, and the drafts of windows already in flight)."""
        ...

    async def close(self) -> None: ...


class NgramDraft:
    """Prompt lookup decoding: match the last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) against earlier
    ones and propose the tokens that followed the most recent earlier match; where those run up to the end of the
    history (the text repeats with a period shorter than ``k``), the proposal repeats them. The index is built
    incrementally: beyond one comparison of the history with what was indexed, a proposal costs O(max_n + k)
    whatever the history's length, and a history that dropped rejected drafts rolls the index back by as many
    positions."""

    name = "ngram"

    def __init__(self, *, max_n: int = 4, min_n: int = 2) -> None:
        self.max_n, self.min_n = max_n, min_n
        self._seen: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        """n-gram -> the position just after its most recent occurrence that has a successor."""
        self._undo: list[list[tuple[tuple[int, ...], int | None]]] = []
        """Per position indexed: the entries of ``_last`` it replaced, to roll back drafts that were rejected."""

    def _index(self, history: Sequence[int]) -> None:
        seen, last = self._seen, self._last
        if len(history) < len(seen) or list(history[:len(seen)]) != seen:
            self._roll_back(common_prefix(seen, history))  # past drafts of windows in flight that were rejected
        for i in range(len(seen), len(history)):
            seen.append(int(history[i]))
            # Every n-gram ending just before position i now has i as its successor's position.
            undo = []
            for n in range(self.min_n, self.max_n + 1):
                if i - n >= 0:
                    key = tuple(seen[i - n:i])
                    undo.append((key, last.get(key)))
                    last[key] = i
            self._undo.append(undo)

    def _roll_back(self, length: int) -> None:
        while len(self._seen) > length:
            self._seen.pop()
            for key, before in reversed(self._undo.pop()):
                if before is None:
                    del self._last[key]
                else:
                    self._last[key] = before

    async def propose(self, history: Sequence[int], k: int) -> list[int]:
        return self.lookup(history, k)

    def lookup(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        self._index(history[:-1])  # the last token's own n-grams have no successor yet
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(history) < n:
                continue
            follow = self._last.get(tuple(int(t) for t in history[len(history) - n:]))
            if follow is not None:
                drafts = [int(t) for t in history[follow:follow + k]]
                # A continuation that runs into the end of the history is a loop of period len - follow: it
                # goes on as the loop does (what a small model stuck repeating itself generates next).
                period = len(history) - follow
                while len(drafts) < k:
                    drafts.append(drafts[len(drafts) - period])
                return drafts
        return []

    async def close(self) -> None:
        return None


class ModelDraft:
    """A small GGUF of the same vocabulary on its own worker thread, decoding greedily. It keeps one session whose
    KV follows the history it is asked about: it drops what no longer matches (rejected drafts) and feeds what is
    new (in one prefill step), then decodes ``k`` tokens."""

    name = "model"

    def __init__(self, engine: StepEngine, *, session_id: str) -> None:
        """``engine``: the draft model's, shared by the node's sessions (started by whoever made it)."""
        backend = engine.backend
        if not isinstance(backend, KvBackend) or not (backend.is_head and backend.is_tail):
            raise ValueError("a draft model must be a whole model whose KV can be cut back")
        self._backend: Backend = backend
        self._engine = engine
        self._session_id = session_id
        self._fed: list[int] = []
        self._opened = False

    async def propose(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        if not self._opened:
            await self._engine.call(lambda: self._backend.open_session(
                self._session_id, prompt_tokens=list(history[:1]), sampling=SamplingParams(temperature=0.0)))
            self._opened = True
        keep = common_prefix(self._fed, history[:-1])
        if keep < len(self._fed):
            kv = self._backend
            assert isinstance(kv, KvBackend)
            await self._engine.call(kv.truncate, self._session_id, keep)
            del self._fed[keep:]
        new = [int(t) for t in history[keep:]]
        chunk = self._backend.max_batch_tokens
        token: int | None = None
        for start in range(0, len(new), chunk):
            part = new[start:start + chunk]
            out = await self._engine.submit(StepInput(self._session_id, len(self._fed), tokens=part,
                                                      sample=start + chunk >= len(new)))
            self._fed.extend(part)
            token = out[0].token
        drafts: list[int] = []
        while token is not None and len(drafts) < k:
            drafts.append(token)
            if len(drafts) == k:
                break
            step = await self._engine.submit(StepInput(self._session_id, len(self._fed), tokens=[token],
                                                       sample=True))
            self._fed.append(token)
            token = step[0].token
        return drafts

    async def close(self) -> None:
        if self._opened:
            with contextlib.suppress(Exception):
                await self._engine.close_session(self._session_id)


async def propose_safely(source: DraftSource, history: Sequence[int], k: int) -> list[int]:
    """Drafts are an optimization: a source that fails proposes nothing (the window is plain decoding)."""
    try:
        return await source.propose(history, k)
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception:  # noqa: BLE001 - the session decodes on without drafts
        return []
