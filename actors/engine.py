"""Runs a backend on one worker thread and batches concurrent sessions' steps into single forward passes.

Continuous batching: while one batch runs, newly submitted steps queue; the next batch takes all of them (up to the
backend's token budget), so a new prompt's prefill chunk joins running decodes instead of waiting for them to finish.
Every other backend call (open, close, tokenize) also runs on the worker thread, because llama.cpp contexts are
not thread-safe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

from actors.backend import Backend, StepInput, StepOutput

T = TypeVar("T")

GATHER_TURNS = 16
"""Event-loop turns the engine waits, before taking a batch, for the sessions of the previous batch to come back."""


@dataclasses.dataclass(slots=True)
class _Pending:
    item: StepInput
    future: asyncio.Future[StepOutput]
    queued_at: float


@dataclasses.dataclass(slots=True)
class StepTiming:
    """What one submitted step cost: time waiting for the worker, and the batched forward pass it rode in."""

    queue_ms: float
    compute_ms: float
    batch_size: int


class StepEngine:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="backend")
        self._pending: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._timings: dict[int, StepTiming] = {}
        self.batches_run = 0
        self.max_batch_seen = 0
        self._expected: set[str] = set()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="step-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for p in self._pending:
            if not p.future.done():
                p.future.set_exception(RuntimeError("node is stopping"))
        self._pending.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run a backend method on the worker thread, serialized with forward passes."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    async def submit(self, item: StepInput) -> tuple[StepOutput, StepTiming]:
        future: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()
        pending = _Pending(item, future, time.perf_counter())
        self._pending.append(pending)
        self._wakeup.set()
        output = await future
        return output, self._timings.pop(id(future))

    def _take_batch(self) -> list[_Pending]:
        budget = self.backend.max_batch_tokens
        batch: list[_Pending] = []
        seen: set[str] = set()
        used = 0
        rest: list[_Pending] = []
        for p in self._pending:
            n = p.item.n_positions
            # A session's steps must stay in order and one per pass; the first item always goes so nothing starves.
            if p.item.session_id in seen or (batch and used + n > budget):
                rest.append(p)
                continue
            batch.append(p)
            seen.add(p.item.session_id)
            used += n
        self._pending = rest
        return batch

    async def _gather(self) -> None:
        # A session submits its next step a few event-loop turns after its last one returned (token handling,
        # publishing, queue hand-offs). Taking the batch at once would catch only the first session back and push
        # the rest into a second pass: decode batches would alternate 1 and n-1 instead of staying whole. A session
        # that ended (or waits on the network) costs at most GATHER_TURNS turns, well under a millisecond.
        for _ in range(GATHER_TURNS):
            if self._expected <= {p.item.session_id for p in self._pending}:
                return
            await asyncio.sleep(0)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            await self._gather()
            batch = [p for p in self._take_batch() if not p.future.cancelled()]
            if not batch:
                continue
            self._expected = {p.item.session_id for p in batch}
            started = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self._executor, self.backend.step, [p.item for p in batch])
            except Exception as exc:  # noqa: BLE001 - every waiter must learn why its step failed
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            compute_ms = (time.perf_counter() - started) * 1e3
            self.batches_run += 1
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            for p, out in zip(batch, outputs, strict=True):
                self._timings[id(p.future)] = StepTiming((started - p.queued_at) * 1e3, compute_ms, len(batch))
                if not p.future.done():
                    p.future.set_result(out)
                else:
                    self._timings.pop(id(p.future), None)
