"""Running the architecture matrix: build a case's GGUF, run it whole and as a chain of shards (backends in one
process, or real nodes behind the real tracker and gateway), and compare what the tail computes.

Every run uses the batch shapes a route uses: the whole prompt in one step (it is shorter than the gateway's prefill
chunk), then one token per step. The reference is the whole GGUF in one llama.cpp context with those same shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import openai

from actors.backend import StepInput, StepOutput
from actors.backends import load_backend
from actors.backends.llamacpp.backend import LlamaCppBackend
from actors.node import Node, NodeConfig
from actors.selfcheck import WARM_UP_SESSION
from actors.tracker import Tracker
from artifacts.synthetic.matrix import Bounds, MatrixCase, ranges
from bus.server import EmbeddedNats
from gateway.app import Gateway
from schemas.session import Prompt, SamplingParams
from schemas.settings import Settings
from tests.support.swarm import Swarms, make_settings, wait_model

THREADS = 1
"""One thread: the matrix runs beside other test processes on two shared cores, where OpenMP barriers of two
threads that get descheduled cost milliseconds per graph node (seconds per step on MoE graphs)."""
N_CTX = 256
N_DECODE = 6
PROMPT = ("The lighthouse keeper returned to the island every spring, and the fishermen came from the north with "
          "stories of strange lights seen over the water at night. ")
"""About 50 tokens with the synthetic vocabulary: longer than every case's 16-position sliding window, shorter
than the gateway's 256-token prefill chunk (so a route prefills it in one step, as the reference does)."""

GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass
class Run:
    picks: list[int]
    logits: list[np.ndarray[Any, np.dtype[np.float32]]]

    def max_diff(self, other: Run) -> float:
        return max(float(np.abs(a - b).max()) for a, b in zip(self.logits, other.logits, strict=True))


def build(case: MatrixCase, quant: str, directory: Path) -> Path:
    """The case's GGUF, written once per directory."""
    path = directory / f"{case.name}-{quant}.gguf"
    if not path.exists():
        case.builder().write(path, quant=quant, seed=16)
    return path


def open_backend(path: Path, shard_dir: Path, start: int | None = None, end: int | None = None, *,
                 allow_unproven: bool = False) -> LlamaCppBackend:
    b = load_backend("llamacpp", model_path=path, n_ctx=N_CTX, max_sessions=1, threads=THREADS, layer_start=start,
                     layer_end=end, shard_dir=shard_dir, allow_unproven=allow_unproven)
    assert isinstance(b, LlamaCppBackend)
    return b


def open_chain(path: Path, shard_dir: Path, bounds: Bounds, *, allow_unproven: bool = False
               ) -> list[LlamaCppBackend]:
    hops: list[LlamaCppBackend] = []
    try:
        for a, b in ranges(bounds):
            hops.append(open_backend(path, shard_dir, a, b, allow_unproven=allow_unproven))
    except BaseException:
        for h in hops:
            h.close()
        raise
    return hops


def prompt_tokens(head: LlamaCppBackend) -> list[int]:
    return head.tokenize(Prompt(text=PROMPT))


def greedy(hops: Sequence[LlamaCppBackend], tokens: list[int], n: int = N_DECODE) -> Run:
    """Prefill in one step, then ``n - 1`` one-token steps, each through every hop: what a route does."""
    for hop in hops:
        hop.open_session("m", prompt_tokens=tokens, sampling=GREEDY)
    run = Run([], [])
    try:
        item = StepInput("m", 0, tokens=tokens, sample=True)
        while len(run.picks) < n:
            outputs: list[StepOutput] = hops[0].step([item])
            for hop in hops[1:]:
                outputs = hop.step([StepInput("m", item.start_position, hidden=outputs[0].hidden, sample=True)])
            token = outputs[0].token
            assert token is not None
            run.picks.append(token)
            run.logits.append(hops[-1].last_logits("m"))
            item = StepInput("m", len(tokens) + len(run.picks) - 1, tokens=[token], sample=True)
    finally:
        for hop in hops:
            hop.close_session("m")
    return run


def kv_growth(hops: Sequence[LlamaCppBackend], tokens: list[int], *, first: int = 2, then: int = 8) -> list[float]:
    """Bytes per position each hop's llama.cpp sequence state grows by, between ``first`` and ``first + then``
    positions (all inside the sliding window, so every layer grows)."""
    for hop in hops:
        hop.open_session("kv", prompt_tokens=tokens, sampling=GREEDY)
    try:
        sizes = []
        for lo, hi in ((0, first), (first, first + then)):
            outputs: list[StepOutput] = hops[0].step([StepInput("kv", lo, tokens=tokens[lo:hi], sample=True)])
            for hop in hops[1:]:
                outputs = hop.step([StepInput("kv", lo, hidden=outputs[0].hidden, sample=True)])
            sizes.append([int(llama_cpp.llama_state_seq_get_size(h._ctx, h.seq_id_of("kv"))) for h in hops])
        return [(b - a) / then for a, b in zip(sizes[0], sizes[1], strict=True)]
    finally:
        for hop in hops:
            hop.close_session("kv")


class RecordingBackend:
    """A real backend that also keeps the tail's picks and the logits they were drawn from, so a test can compare
    what a route computed with the reference run (the node's start-up warm-up left out). Everything else is the
    wrapped backend's."""

    def __init__(self, inner: LlamaCppBackend) -> None:
        self.inner = inner
        self.run = Run([], [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        outputs = self.inner.step(batch)
        for item, out in zip(batch, outputs, strict=True):
            if item.sample and out.token is not None and item.session_id != WARM_UP_SESSION:
                self.run.picks.append(out.token)
                self.run.logits.append(self.inner.last_logits(item.session_id))
        return outputs


@dataclasses.dataclass
class RouteHarness:
    """One real nats-server, tracker and gateway; each route run adds its nodes and removes them afterwards."""

    settings: Settings
    tracker: Tracker
    gateway: Gateway
    started: Swarms
    _ids: itertools.count[int] = dataclasses.field(default_factory=itertools.count)

    @classmethod
    async def start(cls, server: EmbeddedNats, home: Path, **overrides: object) -> RouteHarness:
        # Generous timeouts: the two cores are shared with other test processes.
        options: dict[str, object] = dict(namespace="archmatrix", token_timeout_s=60.0, first_token_timeout_s=120.0,
                                          hop_timeout_s=60.0)
        settings = make_settings(server.url, home, **{**options, **overrides})
        async with Swarms() as starting:
            tracker = await starting.actor(Tracker(settings))
            gateway = await starting.actor(Gateway(settings, port=0))
            return cls(settings, tracker, gateway, starting.pop_all())

    async def stop(self) -> None:
        await self.started.aclose()

    async def route(self, hops: Sequence[LlamaCppBackend], tokens: list[int], n: int = N_DECODE,
                    tail: RecordingBackend | None = None) -> tuple[Run, list[str]]:
        """Greedy completion of ``tokens`` through real nodes serving ``hops`` (in order): the tail's run and the
        node ids the gateway reported as the route. ``tail``: the recording wrapper of ``hops[-1]`` to use."""
        run_id = next(self._ids)
        model = f"m{run_id}"
        tail = tail or RecordingBackend(hops[-1])
        backends: list[Any] = [*hops[:-1], tail]
        async with Swarms() as started:  # the nodes, stopped again after the run
            for i, backend in enumerate(backends):
                await started.actor(Node(NodeConfig(node_id=f"r{run_id}-{i}", model_id=model), backend, self.settings))
            await wait_model(self.tracker, model, timeout=30.0, n_nodes=len(backends))
            client = openai.AsyncOpenAI(base_url=self.gateway.url + "/v1", api_key="unused", max_retries=0,
                                        timeout=300)
            got = await client.completions.create(model=model, prompt=tokens, max_tokens=n, temperature=0,
                                                  extra_body={"ignore_eos": True})
            assert got.usage is not None and got.usage.completion_tokens == n
            route = [h["node_id"] for h in got.model_extra["swarmroute"]["route"]]  # type: ignore[index]
            return tail.run, route
