"""The step engine: its worker thread, continuous batching and chained steps.

The stub backend stands in for the model (a collaborator of the engine, not what these tests prove); it records
every batch it is handed, so batching and ordering are observed directly.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from actors.backend import StepInput, StepOutput
from actors.backends.stub import StubBackend, StubConfig
from actors.node.engine import StepEngine
from actors.node.ring import RingGroups
from schemas.errors import NodeStoppingError
from schemas.node import BackendInfo
from schemas.session import SamplingParams

PROMPT = [1, 72, 105, 33]
GREEDY = SamplingParams(temperature=0.0)


class RecordingStub(StubBackend):
    """The stub backend, remembering the sessions of each batch and the thread that ran it."""

    def __init__(self, **kw: object) -> None:
        super().__init__(StubConfig(n_layers=4, **kw))  # type: ignore[arg-type]
        self.batches: list[list[tuple[str, int]]] = []
        self.threads: set[str] = set()
        self.fail_on: str | None = None

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        self.batches.append([(i.session_id, i.start_position) for i in batch])
        self.threads.add(threading.current_thread().name)
        if self.fail_on is not None and any(i.session_id == self.fail_on for i in batch):
            raise RuntimeError(f"boom in {self.fail_on}")
        return super().step(batch)


async def open_session(engine: StepEngine, sid: str) -> None:
    await engine.call(lambda: engine.backend.open_session(sid, prompt_tokens=PROMPT, sampling=GREEDY))


def follow_up_to(limit: int, seen: list[int] | None = None):  # type: ignore[no-untyped-def]
    """A follow function: feed each sampled token back until ``limit`` positions are in the KV."""
    def follow(item: StepInput, out: StepOutput) -> StepInput | None:
        if seen is not None:
            seen.append(threading.get_ident())
        nxt = item.start_position + item.n_positions
        if nxt >= limit or out.token is None:
            return None
        return StepInput(item.session_id, nxt, tokens=[out.token], sample=True)
    return follow


async def drain(chain) -> list[int]:  # type: ignore[no-untyped-def]
    tokens = []
    while (result := await chain.next()) is not None:
        tokens.append(result[0].token)
    return tokens


@pytest.fixture
async def engine():  # type: ignore[no-untyped-def]
    e = StepEngine(RecordingStub())
    await e.start()
    yield e
    await e.stop()


async def test_submit_runs_on_the_worker_thread_and_times_the_step(engine: StepEngine) -> None:
    await open_session(engine, "a")
    began = time.perf_counter()
    out, timing = await engine.submit(StepInput("a", 0, tokens=PROMPT, sample=True))
    wall_ms = (time.perf_counter() - began) * 1e3
    assert out.token is not None
    # Both are measured inside the submit: queued once submitted, then computed, before the result came back.
    assert timing.batch_size == 1 and timing.compute_ms > 0
    assert 0 <= timing.queue_ms <= wall_ms - timing.compute_ms
    assert engine.backend.threads == {"backend"}  # type: ignore[attr-defined]


async def test_a_chain_equals_the_same_steps_submitted_one_by_one(engine: StepEngine) -> None:
    for sid in ("chained", "manual"):
        await open_session(engine, sid)
    first, _ = await engine.submit(StepInput("chained", 0, tokens=PROMPT, sample=True))
    worker_threads: list[int] = []
    chain = engine.chain(StepInput("chained", len(PROMPT), tokens=[first.token], sample=True),  # type: ignore[list-item]
                         follow_up_to(len(PROMPT) + 12, worker_threads))
    chained = await drain(chain)

    manual: list[int] = []
    out, _ = await engine.submit(StepInput("manual", 0, tokens=PROMPT, sample=True))
    token, position = out.token, len(PROMPT)
    while position < len(PROMPT) + 12:
        out, _ = await engine.submit(StepInput("manual", position, tokens=[token], sample=True))  # type: ignore[list-item]
        manual.append(out.token)  # type: ignore[arg-type]
        token, position = out.token, position + 1
    assert chained == manual and len(chained) == 12
    assert threading.get_ident() not in worker_threads  # follow ran on the worker, not the loop


async def test_concurrent_chains_share_forward_passes(engine: StepEngine) -> None:
    sids = [f"s{i}" for i in range(4)]
    for sid in sids:
        await open_session(engine, sid)
    chains = [engine.chain(StepInput(sid, 0, tokens=PROMPT, sample=True), follow_up_to(len(PROMPT) + 20))
              for sid in sids]
    results = await asyncio.gather(*(drain(c) for c in chains))
    assert all(len(r) == 21 for r in results)
    batches = engine.backend.batches  # type: ignore[attr-defined]
    assert max(len(b) for b in batches) == 4
    # Once all four run, every pass carries all four: a chain's next step is queued before the pass is delivered.
    full = [len(b) == 4 for b in batches]
    assert sum(full) >= 18


async def test_a_stopped_chain_queues_nothing_more(engine: StepEngine) -> None:
    await open_session(engine, "a")
    chain = engine.chain(StepInput("a", 0, tokens=PROMPT, sample=True), follow_up_to(10_000))
    got = [await chain.next() for _ in range(3)]
    assert all(r is not None for r in got)
    chain.stop()
    await engine.call(lambda: None)  # a call runs between passes: at most the pass already running completes
    settled = len(engine.backend.batches)  # type: ignore[attr-defined]
    await asyncio.sleep(0.05)
    assert len(engine.backend.batches) == settled  # type: ignore[attr-defined]
    assert settled < 1000  # the chain may run ahead of its consumer, but it stopped long before its follow would


async def test_a_failed_pass_fails_every_waiter_and_ends_the_chain(engine: StepEngine) -> None:
    for sid in ("ok", "bad"):
        await open_session(engine, sid)
    engine.backend.fail_on = "bad"  # type: ignore[attr-defined]
    chain = engine.chain(StepInput("bad", 0, tokens=PROMPT, sample=True), follow_up_to(100))
    with pytest.raises(RuntimeError, match="boom in bad"):
        await chain.next()
    out, _ = await engine.submit(StepInput("ok", 0, tokens=PROMPT, sample=True))  # the worker lives on
    assert out.token is not None


async def test_a_follow_function_that_raises_ends_only_its_chain(engine: StepEngine) -> None:
    await open_session(engine, "a")

    def broken(item: StepInput, out: StepOutput) -> StepInput | None:
        raise ValueError("follow broke")

    chain = engine.chain(StepInput("a", 0, tokens=PROMPT, sample=True), broken)
    assert await chain.next() is not None  # the step itself ran and is delivered
    with pytest.raises(ValueError, match="follow broke"):
        await chain.next()


async def test_backend_errors_from_calls_reach_the_caller(engine: StepEngine) -> None:
    await open_session(engine, "a")
    with pytest.raises(Exception, match="already open"):
        await open_session(engine, "a")


async def test_stop_fails_queued_work_and_is_safe_twice() -> None:
    backend = RecordingStub(delay_s=0.05)
    engine = StepEngine(backend)
    await engine.start()
    for sid in ("a", "b"):
        await open_session(engine, sid)
    first = asyncio.ensure_future(engine.submit(StepInput("a", 0, tokens=PROMPT)))
    await asyncio.sleep(0.01)  # "a" is running; "b" queues behind it
    second = asyncio.ensure_future(engine.submit(StepInput("a", len(PROMPT), tokens=[5])))
    await asyncio.sleep(0)
    await engine.stop()
    await engine.stop()
    assert (await first)[0] is not None  # the running pass completed
    with pytest.raises(NodeStoppingError):
        await second
    with pytest.raises(NodeStoppingError):
        await engine.submit(StepInput("b", 0, tokens=PROMPT))


async def test_a_lone_decode_step_runs_inline_and_a_second_session_brings_back_the_worker(engine: StepEngine) -> None:
    backend = engine.backend
    for sid in ("a", "b"):
        await open_session(engine, sid)
    out, _ = await engine.submit(StepInput("a", 0, tokens=PROMPT, sample=True))
    assert backend.threads == {"backend"}  # type: ignore[attr-defined]  # a prefill chunk always goes to the worker
    out, timing = await engine.submit(StepInput("a", len(PROMPT), tokens=[out.token], sample=True))  # type: ignore[list-item]
    assert threading.current_thread().name in backend.threads  # type: ignore[attr-defined]
    assert timing.queue_ms == 0.0 and timing.batch_size == 1

    backend.threads.clear()  # type: ignore[attr-defined]
    other, _ = await engine.submit(StepInput("b", 0, tokens=PROMPT, sample=True))
    results = await asyncio.gather(
        engine.submit(StepInput("a", len(PROMPT) + 1, tokens=[out.token], sample=True)),  # type: ignore[list-item]
        engine.submit(StepInput("b", len(PROMPT), tokens=[other.token], sample=True)))  # type: ignore[list-item]
    assert backend.threads == {"backend"}  # type: ignore[attr-defined]  # two active sessions: batched on the worker
    assert [t.batch_size for _, t in results] == [2, 2]


async def test_an_inline_step_and_the_worker_never_overlap(engine: StepEngine) -> None:
    """Many sessions submitting at once, some alone for a while: the backend never sees two passes at a time."""
    backend = engine.backend
    running = 0
    overlaps = 0
    original = backend.step

    def guarded(batch: list[StepInput]) -> list[StepOutput]:
        nonlocal running, overlaps
        running += 1
        overlaps += running > 1
        try:
            return original(batch)
        finally:
            running -= 1

    backend.step = guarded  # type: ignore[method-assign]

    async def session(sid: str, steps: int) -> None:
        await open_session(engine, sid)
        out, _ = await engine.submit(StepInput(sid, 0, tokens=PROMPT, sample=True))
        for i in range(steps):
            out, _ = await engine.submit(StepInput(sid, len(PROMPT) + i, tokens=[out.token], sample=True))  # type: ignore[list-item]

    await session("solo", 10)
    await asyncio.gather(*(session(f"s{i}", 10) for i in range(4)))
    assert overlaps == 0


async def test_a_step_queued_while_the_worker_takes_a_batch_is_not_lost(engine: StepEngine) -> None:
    """The worker replaces its queue when it takes a batch: a step queued at that very moment (its caller waiting
    for the lock meanwhile) lands in the new queue and runs. It once went into the list just dropped, and the
    session waited for that step for good (4 sessions on a 2-node route hung within a minute)."""
    await open_session(engine, "a")
    held, release = threading.Event(), threading.Event()

    def taking_a_batch() -> None:
        with engine._cond:  # what the worker holds while it takes a batch
            held.set()
            release.wait(5)
            engine._steps = list(engine._steps)  # ... and the queue it leaves behind is a new list

    taker = threading.Thread(target=taking_a_batch)
    taker.start()
    held.wait(5)
    threading.Timer(0.05, release.set).start()
    step = engine.enqueue(StepInput("a", 0, tokens=PROMPT, sample=True))  # blocks until the taker lets go
    taker.join()
    out, _ = await asyncio.wait_for(step, 5)
    assert out.token is not None


async def test_a_call_that_arrives_while_the_worker_gathers_runs_before_the_steps_queued_after_it(
        engine: StepEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``call_soon`` promises its call runs before any step queued after it: a speculating head rolls a session's
    KV back with a call and queues the next step at once. The worker, gathering a pass's cohort, once took the
    steps queued behind a call that had ended its wait into the pass first (an ngram session stepped at position
    27 while its KV ended at 30)."""
    import actors.node.engine as engine_module

    for sid in ("a", "b"):
        await open_session(engine, sid)
    await asyncio.gather(*engine.enqueue_group([StepInput(s, 0, tokens=PROMPT, sample=True) for s in ("a", "b")]))
    monkeypatch.setattr(engine_module, "GATHER_WINDOW_S", 5.0)  # the worker now waits long for b, a's cohort
    first = engine.enqueue(StepInput("a", len(PROMPT), tokens=[7], sample=True), inline=False)
    await asyncio.sleep(0.1)  # the worker is gathering
    batches: list[list[tuple[str, int]]] = engine.backend.batches  # type: ignore[attr-defined]
    with engine._cond:  # both queued before the worker wakes
        call = engine.call_soon(lambda: batches.append([("call", -1)]))
        second = engine.enqueue(StepInput("b", len(PROMPT), tokens=[7], sample=True), inline=False)
    await asyncio.wait_for(asyncio.gather(call, first, second), 5)
    at_call = batches.index([("call", -1)])
    assert ("b", len(PROMPT)) in [entry for batch in batches[at_call + 1:] for entry in batch], batches


@pytest.mark.parametrize(("groups", "expected"), [(1, [4]), (2, [2, 2])])
async def test_a_heads_ring_steps_ride_in_as_many_groups_as_the_grouping_says(groups: int,
                                                                             expected: list[int]) -> None:
    """Four sessions' decode steps on a 2-hop route, queued together: one pass for all (1 group), or two passes of
    two that then follow each other around the ring (2 groups). Other steps are not grouped."""
    engine = StepEngine(RecordingStub(), ring=RingGroups(groups))
    await engine.start()
    try:
        sids = [f"s{i}" for i in range(4)]
        for sid in sids:
            await open_session(engine, sid)
        tokens = {}
        for sid in sids:
            out, _ = await engine.submit(StepInput(sid, 0, tokens=PROMPT, sample=True))
            tokens[sid] = out.token
        backend = engine.backend
        backend.batches.clear()  # type: ignore[attr-defined]
        steps = [engine.enqueue(StepInput(sid, len(PROMPT), tokens=[tokens[sid]], sample=True),  # type: ignore[list-item]
                                inline=False, ring=("head", "tail")) for sid in sids]
        await asyncio.gather(*steps)
        assert [len(b) for b in backend.batches] == expected  # type: ignore[attr-defined]
        backend.batches.clear()  # type: ignore[attr-defined]
        await asyncio.gather(*(engine.enqueue(StepInput(sid, len(PROMPT) + 1, tokens=[tokens[sid]],  # type: ignore[list-item]
                                                        sample=True), inline=False) for sid in sids))
        assert [len(b) for b in backend.batches] == [4], "steps without a ring are one pass"  # type: ignore[attr-defined]
    finally:
        await engine.stop()


class ThreadedStub(RecordingStub):
    """Says it computes on two threads, as a llama.cpp backend with ``threads=2`` does."""

    @property
    def info(self) -> BackendInfo:
        return super().info.model_copy(update={"threads": 2})


async def test_a_multi_threaded_backend_computes_every_step_on_the_worker_thread() -> None:
    """llama.cpp and torch compute a pass on several OpenMP threads, and libgomp keeps a thread pool per thread that
    starts one: passes from the loop thread as well as the worker leave two pools, and every pass slows down ~1.6x
    (measured: the engine's docstring). So with more than one thread nothing runs inline, not even a lone decode."""
    backend = ThreadedStub()
    engine = StepEngine(backend)
    await engine.start()
    try:
        assert not engine.may_inline
        await open_session(engine, "a")
        out, _ = await engine.submit(StepInput("a", 0, tokens=PROMPT, sample=True))
        for i in range(3):
            out, timing = await engine.submit(StepInput("a", len(PROMPT) + i, tokens=[out.token], sample=True))  # type: ignore[list-item]
        assert backend.threads == {"backend"}
    finally:
        await engine.stop()


async def test_decoding_sessions_ride_every_pass_ahead_of_queued_prefill_chunks() -> None:
    """Issue #30: a burst of prompts queued ahead of a running session's decode step does not hold it back. A pass
    takes the decoding session's step first and fills the rest of the budget with prefill chunks, oldest first,
    keeping room for the oldest one; before, the chunks filled the budget in queue order and the decode step
    waited for all of them."""
    backend = RecordingStub(max_batch_tokens=8)
    engine = StepEngine(backend)
    await engine.start()
    try:
        for sid in ("run", "p1", "p2", "p3"):
            await open_session(engine, sid)
        out, _ = await engine.submit(StepInput("run", 0, tokens=PROMPT, sample=True))
        backend.batches.clear()
        held, go = threading.Event(), threading.Event()

        def busy() -> None:  # the worker busy while the queue fills
            held.set()
            go.wait(5)

        blocker = engine.call_soon(busy)
        await asyncio.to_thread(held.wait, 5)
        chunks = [engine.enqueue(StepInput(sid, 0, tokens=PROMPT), inline=False, prefill=True)
                  for sid in ("p1", "p2", "p3")]
        decode = engine.enqueue(StepInput("run", len(PROMPT), tokens=[out.token], sample=True),  # type: ignore[list-item]
                                inline=False)
        go.set()
        await blocker
        await asyncio.gather(decode, *chunks)
        assert backend.batches[0] == [("run", len(PROMPT)), ("p1", 0)], backend.batches
        assert backend.batches[1:] == [[("p2", 0), ("p3", 0)]], backend.batches
    finally:
        await engine.stop()


async def test_a_sessions_first_step_past_prefill_and_its_close_end_its_prefill_ticket(engine: StepEngine) -> None:
    engine.prefill_rate = 100.0  # as if measured: both tickets fit at once
    for sid in ("a", "b"):
        await open_session(engine, sid)
        await engine.prefills.admit(sid, len(PROMPT), 1.0)
    out, _ = await engine.enqueue(StepInput("a", 0, tokens=PROMPT, sample=True), prefill=True)
    assert engine.prefills.holds("a"), "its prefill chunk keeps the ticket"
    await engine.enqueue(StepInput("a", len(PROMPT), tokens=[out.token], sample=True))  # type: ignore[list-item]
    assert not engine.prefills.holds("a") and engine.prefills.holds("b")
    await engine.close_session("b")
    assert not engine.prefills.holds("b") and engine.prefills.in_flight == 0
