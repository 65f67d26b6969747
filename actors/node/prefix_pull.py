"""Prefixes across routes (issue #26): a hop whose route lacks a prompt's prefix pulls it, hop by hop, from a node of
the same layers on another route that kept it (the tracker names one per hop, ``Hop.prefix_source``), when pulling
is cheaper than computing.

Each hop decides for itself (``PullPolicy``), from the link rate it measured pulling from that node before and its
own measured prefill rate: pulling ``b`` bytes at ``r`` bytes/s against computing ``p`` positions at ``q``
positions/s. An unknown link is measured by its first piece, and the choice is made again before every piece with
what the pieces so far measured: a source that turns out slow (a loaded machine, a thin link) stops the pull, and
what is left is computed (forced KV loads can lose badly under load: llm-d measured a p99 TTFT of 57.5 s with them
against 3.4 s recomputing). ``prefix_pull = never`` always computes, ``always`` always pulls.

Nothing pulled is trusted: every piece must hash to the digest its offer named (``bus.snapshot.decode``), be the
piece named (index, start, parent digest, model, layers), and hold the prompt's tokens (the offer's token hash, and
each whole piece's prefix hash). A pull that fails any check, or that the backend refuses, is dropped and the hop
computes those positions; the session never uses a byte of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from actors.node.reuse import Reuse
from bus import snapshot as blobs
from bus.nodeclient import NodeClient
from schemas.errors import HopError, SnapshotError
from schemas.node import LayerRange
from schemas.prefix_offer import PrefixOffer, PrefixOfferRequest
from schemas.snapshot import SnapshotSegment, StandbyRef, prefix_hash

log = logging.getLogger(__name__)

PULL_MODES = ("auto", "never", "always")
EWMA = 0.5
"""Weight of the newest measurement of a rate."""
IN_FLIGHT = 8
"""Pieces requested at once after the first."""


class PullPolicy:
    """Pull or compute, for one hop. ``link_bps`` (per source node) and ``prefill_pps`` are its inputs, as
    measured; an operator or a test may set them."""

    def __init__(self, prefill_rate: Callable[[], float | None], *, mode: str = "auto") -> None:
        if mode not in PULL_MODES:
            raise ValueError(f"prefix_pull must be one of {', '.join(PULL_MODES)}, not {mode!r}")
        self.mode = mode
        self._prefill_rate = prefill_rate
        self.link_bps: dict[str, float] = {}
        """Bytes per second pulled from each source node, request latency included."""
        self.prefill_pps: float | None = None
        """This hop's prefill rate in positions per second; None: read the measured one."""

    def observe(self, node: str, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-6)
        old = self.link_bps.get(node)
        self.link_bps[node] = rate if old is None else EWMA * rate + (1 - EWMA) * old

    def prefill(self) -> float | None:
        return self.prefill_pps if self.prefill_pps is not None else self._prefill_rate()

    def estimate(self, node: str, nbytes: int, positions: int) -> tuple[float | None, float | None]:
        """(seconds to pull ``nbytes`` from ``node``, seconds to compute ``positions``); None where unknown."""
        rate, pps = self.link_bps.get(node), self.prefill()
        return (nbytes / rate if rate else None, positions / pps if pps else None)

    def worth(self, node: str, nbytes: int, positions: int) -> bool:
        """Whether pulling ``nbytes`` beats computing ``positions``; unknown rates pull (the first piece measures
        the link, and the choice is made again)."""
        if self.mode != "auto":
            return self.mode == "always"
        pull_s, compute_s = self.estimate(node, nbytes, positions)
        return pull_s is None or compute_s is None or pull_s < compute_s


class PrefillRate:
    """A node's prefill rate, from its cumulative counters (positions computed, seconds computing prefill steps):
    positions per second over what was computed since it was last asked, smoothed; None before any prefill."""

    def __init__(self, totals: Callable[[], tuple[float, float]]) -> None:
        self._totals = totals
        self._last = (0.0, 0.0)
        self.rate: float | None = None

    def __call__(self) -> float | None:
        positions, seconds = self._totals()
        d_pos, d_sec = positions - self._last[0], seconds - self._last[1]
        if d_pos > 0 and d_sec > 0:
            rate = d_pos / d_sec
            self.rate = rate if self.rate is None else EWMA * rate + (1 - EWMA) * self.rate
            self._last = (positions, seconds)
        return self.rate


class PrefixPull:
    def __init__(self, reuse: Reuse, client: NodeClient, policy: PullPolicy, *, model_id: str, layers: LayerRange,
                 timeout_s: float) -> None:
        self._reuse = reuse
        self._client = client
        self.policy = policy
        self._model_id = model_id
        self._layers = layers
        self._timeout_s = timeout_s
        self.pulled_positions = 0
        self.pulled_bytes = 0
        self.declined = 0
        """Offers the policy chose to compute instead (wholly, or the rest after some pieces)."""
        self.rejected = 0
        """Pulls dropped because a piece failed a check (or the backend refused them): computed instead."""

    async def pull(self, session_id: str, prompt: list[int], have: int, limit: int | None, chunk: int,
                   source: StandbyRef) -> int:
        """The session holds ``[0, have)`` of ``prompt``: pull what ``source`` holds beyond, up to ``limit``
        positions, if that is cheaper than computing it. Returns where the session's KV now ends."""
        if not self._reuse.enabled or self.policy.mode == "never" or len(prompt) < 2:
            return have
        try:
            offer = await self._client.prefix_offer(
                source.node_id, source.endpoint, PrefixOfferRequest(
                    session_id=session_id, model_id=self._model_id, layers=self._layers, tokens=prompt, have=have),
                capability=source.capability, timeout=self._timeout_s)
        except HopError as exc:
            log.info("session %s: no prefix offer from %s: %s", session_id[:8], source.node_id, exc)
            return have
        want = min(offer.reusable, len(prompt) - 1, limit if limit is not None else len(prompt))
        want = self._reuse.whole(want, chunk)
        if want <= have or not offer.segments:
            return have
        try:
            pieces, end = await self._fetch(session_id, prompt, offer, have, want, source)
        except (SnapshotError, HopError) as exc:
            self.rejected += 1
            log.warning("session %s: the prefix pulled from %s is dropped (%s); computing it", session_id[:8],
                        source.node_id, exc)
            return have
        want = min(want, end)
        if want <= have:
            return have
        try:
            placed = await self._reuse.place_pulled(session_id, pieces, offer.start, end, want)
        except SnapshotError as exc:
            self.rejected += 1
            log.warning("session %s: the backend refused the prefix pulled from %s (%s); computing it",
                        session_id[:8], source.node_id, exc)
            return min(have, offer.start)
        if not placed:
            return 0
        self.pulled_positions += want - offer.start
        self.pulled_bytes += sum(len(p) for p in pieces)
        return want

    async def _fetch(self, session_id: str, prompt: list[int], offer: PrefixOffer, have: int, want: int,
                     source: StandbyRef) -> tuple[list[bytes], int]:
        """The offer's pieces up to ``want``, each checked, for as long as the policy says pulling the rest beats
        computing it; the pieces and where they end (``have`` or less when none was worth pulling). The first
        piece goes alone (it measures an unknown link), then up to ``IN_FLIGHT`` at a time."""
        if offer.token_hash != prefix_hash(prompt[:offer.reusable]):
            raise SnapshotError(f"the offer holds other tokens than the prompt's first {offer.reusable}")
        named = [s for s in offer.segments if s.start < want]
        pieces: list[bytes] = []
        end, parent = offer.start, ""
        while len(pieces) < len(named):
            at = len(pieces)
            rest = named[at:]
            if not self.policy.worth(source.node_id, sum(s.size for s in rest), want - max(have, rest[0].start)):
                self.declined += 1
                break
            batch = range(at, min(at + (IN_FLIGHT if at else 1), len(named)))
            started = time.perf_counter()
            bodies = await asyncio.gather(*(self._client.get_prefix_piece(
                source.node_id, source.endpoint, offer.offer, i, timeout=self._timeout_s) for i in batch))
            self.policy.observe(source.node_id, sum(len(b) for b in bodies), time.perf_counter() - started)
            for index, body in zip(batch, bodies, strict=True):
                segment, blob = blobs.decode(body)
                self._check(segment, named[index], index, parent, end, prompt, want)
                pieces.append(blob)
                end, parent = segment.end, segment.digest
        return pieces, (end if pieces else min(have, offer.start))

    def _check(self, got: SnapshotSegment, named: SnapshotSegment, index: int, parent: str, start: int,
               prompt: list[int], want: int) -> None:
        problem = (f"is {got.digest[:16]}..., not the offered {named.digest[:16]}..." if got.digest != named.digest
                   else f"is of model {got.model_id}" if got.model_id != self._model_id
                   else f"holds layers {got.layers}, not {self._layers}" if got.layers != self._layers
                   else f"is piece {got.index} from position {got.start}"
                   if (got.index, got.start, got.parent) != (index, start, parent)
                   else "holds other tokens than the prompt's" if got.end <= want
                   and got.prefix_hash != prefix_hash(prompt[:got.end])
                   else "")
        if problem:
            raise SnapshotError(f"prefix piece {index} {problem}")
