"""A simulated fleet for the control plane at scale (issue #28 item 4): many lightweight nodes, one asyncio task.

A simulated node is only what the control plane sees of a node: its advertisement, put into the real registry
(JetStream KV) every heartbeat, exactly as ``actors.node`` puts it (same subject, same codec, same fields), and
deleted on a clean leave. It serves no HTTP and computes nothing (the route opens measured are the tracker's:
choosing and signing a route, not the sessions on it). Heartbeats are spread evenly over the interval, as the
independent timers of real nodes are, so the registry sees a steady rate, not a burst per beat.

Churn: ``churn(rate)`` makes ``rate`` joins or leaves per second, half of the leaves clean (the key deleted, as
SIGTERM does) and half crashes (heartbeats stop; the registry's TTL and the tracker's liveness cut them off).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
import time
from collections.abc import Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from bus import codec
from bus.subjects import Subjects
from schemas.node import BackendInfo, Capacity, LayerRange, NodeAdvertisement

HIDDEN = 640
TICK_S = 0.02
"""Heartbeat granularity: a node's put is at most this late against its even share of the interval."""


@dataclasses.dataclass
class SimModel:
    """A model the fleet serves: its name, layer count and the shard ranges its nodes take, in turn."""

    name: str
    n_layers: int
    ranges: list[tuple[int, int]]

    def advert(self, node_id: str, layers: tuple[int, int], max_sessions: int) -> NodeAdvertisement:
        start, end = layers
        return NodeAdvertisement(
            node_id=node_id, endpoint=f"http://127.0.0.1:9/{node_id}", model_id=self.name,
            layers=LayerRange(start=start, end=end), is_head=start == 0, is_tail=end == self.n_layers,
            backend=BackendInfo(kind="stub", model_name=self.name, n_layers=self.n_layers, hidden_size=HIDDEN,
                                hidden_shape=[HIDDEN], context_length=4096),
            capacity=Capacity(max_sessions=max_sessions, max_context=4096))


def even_ranges(n_layers: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous ranges covering ``[0, n_layers)``."""
    bounds = [round(i * n_layers / shards) for i in range(shards + 1)]
    return list(itertools.pairwise(bounds))


@dataclasses.dataclass
class Counters:
    puts: int = 0
    put_errors: int = 0
    joins: int = 0
    clean_leaves: int = 0
    crashes: int = 0


class SimFleet:
    """``async with SimFleet(nc, subjects, heartbeat_s) as fleet``: add nodes with ``add``, churn with ``churn``."""

    def __init__(self, nc: NATS, subjects: Subjects, heartbeat_s: float, *, max_sessions: int = 8,
                 seed: int = 0) -> None:
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self._subjects = subjects
        self._heartbeat_s = heartbeat_s
        self._max_sessions = max_sessions
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self.nodes: dict[str, NodeAdvertisement] = {}
        """Live simulated nodes (heartbeating), by id."""
        self.gone: dict[str, float] = {}
        """Node id -> when it left (monotonic): a route naming it after the registry's TTL is a tracker bug."""
        self.counters = Counters()
        self._models: list[SimModel] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> SimFleet:
        self._tasks.append(asyncio.create_task(self._beat(), name="sim-heartbeats"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)

    async def add(self, model: SimModel, count: int, *, layers: tuple[int, int] | None = None) -> list[str]:
        """``count`` nodes of ``model`` (ranges in turn, or all ``layers``), each put once now."""
        if model not in self._models:
            self._models.append(model)
        added = []
        for i in range(count):
            node_id = f"sim{next(self._ids)}"
            rng = layers or model.ranges[i % len(model.ranges)]
            self.nodes[node_id] = model.advert(node_id, rng, self._max_sessions)
            added.append(node_id)
        await asyncio.gather(*(self._put(n) for n in added))
        return added

    async def _put(self, node_id: str) -> None:
        advert = self.nodes.get(node_id)
        if advert is None:
            return
        advert.sent_at = time.time()
        try:
            await self._js.publish(self._subjects.registry_key_subject(node_id), codec.encode(advert), timeout=5)
            self.counters.puts += 1
        except Exception:  # noqa: BLE001 - counted: a put the server refused or lost is a finding, not a crash
            self.counters.put_errors += 1

    async def leave(self, node_id: str, *, clean: bool) -> None:
        if self.nodes.pop(node_id, None) is None:
            return
        self.gone[node_id] = time.monotonic()
        if clean:
            self.counters.clean_leaves += 1
            with contextlib.suppress(Exception):
                kv = await self._js.key_value(self._subjects.registry_bucket)
                await kv.delete(node_id)
        else:
            self.counters.crashes += 1

    def churn(self, rate: float) -> None:
        """``rate`` joins or leaves per second from now on, keeping the fleet's size about constant."""
        self._tasks.append(asyncio.create_task(self._churn(rate), name="sim-churn"))

    async def _churn(self, rate: float) -> None:
        while True:
            await asyncio.sleep(1 / rate)
            if self._rng.random() < 0.5 and self.nodes:
                victim = self._rng.choice(sorted(self.nodes))
                self._spawn(self.leave(victim, clean=self._rng.random() < 0.5))
            elif self._models:
                self.counters.joins += 1
                self._spawn(self._join())

    async def _join(self) -> None:
        await self.add(self._rng.choice(self._models), 1)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _beat(self) -> None:
        # One pass over the fleet per heartbeat, in ticks: each tick puts the nodes whose offset fell in it.
        while True:
            started = time.monotonic()
            ids = list(self.nodes)
            done = 0
            while done < len(ids):
                await asyncio.sleep(TICK_S)
                due = min(len(ids), int(len(ids) * (time.monotonic() - started) / self._heartbeat_s) + 1)
                for node_id in ids[done:due]:
                    self._spawn(self._put(node_id))
                done = due
            rest = started + self._heartbeat_s - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)
