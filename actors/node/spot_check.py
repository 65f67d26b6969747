"""Spot checks on a node (issue #28), in all three roles, always off every session's path.

* *checked*: a sampled session's hop seals a receipt (``actors.node.spot_receipt``); ``submit`` asks the trackers
  for a checker (a node serving the same layers, not this one) and posts the receipt to it;
* *checker* (``POST /v1/spot-checks``, answered 202 at once): recomputes the receipt's frames in a scratch session
  of its own backend, in the chunks the checked node computed them in, and compares (``actors.node.spot_compare``).
  On a disagreement it asks the trackers for a referee (a third node of the range) and reports both verdicts to
  them as a ``Dispute``; the trackers evict whoever the referee contradicts;
* *referee* (``POST /v1/spot-checks/referee``): recomputes and answers its verdict.

A recomputation is an ordinary session of the backend (it takes a free sequence, or the check is skipped), so it
batches with the node's own sessions like any step; at most ``MAX_CHECKS`` run at once, further receipts get a 429.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Awaitable, Callable

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from actors.backend import Backend, Hidden, StepInput, TopLogits
from actors.node.engine import StepEngine
from actors.node.metrics import NodeMetrics
from actors.node.spot_compare import Band, argmax_draws, compare, compare_logits, wrong_draw
from actors.node.spot_receipt import Sealed, SpotRecorder, top_of
from bus.http_edge import read_body
from bus.nodeclient import NodeClient
from schemas.errors import BadRequestError, CapacityError
from schemas.session import SamplingParams, SessionOpen
from schemas.settings import Settings
from schemas.spot_check import CheckerReply, CheckerRequest, Dispute, DisputeReply, SpotReceipt, SpotRole, SpotVerdict

log = logging.getLogger(__name__)
SCRATCH_PREFIX = "spot-"
"""The id prefix of the scratch sessions a check recomputes a receipt in (they are no client's sessions)."""
MAX_CHECKS = 2
"""Recomputations one node runs at once (as checker or referee); more receipts are refused with a 429."""
POST_TIMEOUT_S = 10.0

AskChecker = Callable[[CheckerRequest], Awaitable[CheckerReply]]
ReportDispute = Callable[[Dispute], Awaitable[DisputeReply]]


class SpotChecks:
    def __init__(self, *, node_id: str, model_id: str, build_id: str, kernels_id: str, backend: Backend,
                 engine: StepEngine,
                 settings: Settings, metrics: NodeMetrics, ask_checker: AskChecker,
                 report_dispute: ReportDispute, client: NodeClient) -> None:
        self.node_id = node_id
        self._client = client
        self.model_id = model_id
        self.build_id = build_id
        self.kernels_id = kernels_id
        self._backend = backend
        self._engine = engine
        self._max_body = settings.max_frame_bytes
        self._band = band_of(settings)
        self._metrics = metrics
        self._ask_checker = ask_checker
        self._report_dispute = report_dispute
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = 0
        self._rate = settings.spot_check_rate
        self._positions = settings.spot_check_positions
        self._rng = random.Random()
        self.manifest_id = ""
        self.clearance: int | None = None
        """How many times this node's operator cleared an eviction of it, as the trackers last said (a cleared note,
        a checker reply); None until they say. Each receipt carries the value its session opened under."""

    def cleared(self, clearance: int | None) -> None:
        """The trackers told this node its clearance generation; it never goes back."""
        if clearance is not None and (self.clearance is None or clearance > self.clearance):
            self.clearance = clearance

    @property
    def busy(self) -> bool:
        """A check, a recomputation or a dispute of this node is under way."""
        return bool(self._tasks) or self._running > 0

    def routes(self) -> list[HttpRoute]:
        return [HttpRoute("/v1/spot-checks", self._check, methods=["POST"]),
                HttpRoute("/v1/spot-checks/referee", self._referee, methods=["POST"])]

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- checked -----------------------------------------------------------------------------------------------

    def recorder_for(self, request: SessionOpen, reused: int) -> SpotRecorder | None:
        """A receipt for a sampled session (``spot_check_rate``) that can be recomputed from position 0: one
        choice, no verify windows, nothing reused or imported."""
        if (self._rate <= 0 or request.n > 1 or request.speculate is not None or request.resume is not None
                or reused or self._rng.random() >= self._rate):
            return None
        hop = request.route.hops[request.hop_index]
        tail = request.hop_index == len(request.route.hops) - 1
        return SpotRecorder(session_id=request.session_id, model_id=self.model_id, manifest_id=self.manifest_id,
                            layers=hop.layers, node_id=self.node_id, build_id=self.build_id,
                            hidden_shape=tuple(self._backend.info.hidden_shape), limit=self._positions,
                            ready=self.submit, top_k=self._band.top_k if tail else 0, kernels_id=self.kernels_id,
                            clearance=self.clearance, greedy=argmax_draws(request.sampling))

    def submit(self, sealed: Sealed) -> None:
        """A session's receipt is sealed: have another node of the range recompute it (in the background)."""
        self._metrics.spot_checks.labels(role="checked", outcome="submitted").inc()
        self._spawn(self._submit(sealed), f"spot-submit-{sealed.receipt.session_id[:8]}")

    async def _submit(self, sealed: Sealed) -> None:
        receipt = sealed.receipt
        try:
            checker = await self._ask_checker(CheckerRequest(model_id=receipt.model_id, layers=receipt.layers,
                                                             exclude=[self.node_id], build_id=self.build_id,
                                                             kernels_id=self.kernels_id, node_id=self.node_id))
            self.cleared(checker.clearance)
            if not checker.node_id:
                log.info("no checker for session %s's layers %s: %s", receipt.session_id[:8], receipt.layers,
                         checker.error)
                self._metrics.spot_checks.labels(role="checked", outcome="no_checker").inc()
                return
            # The node's own client: TLS with its identity, the checker's key pinned (issue #29).
            answer = await self._client.post_receipt(checker.node_id, checker.endpoint, sealed.encode(),
                                                     timeout=POST_TIMEOUT_S)
            if answer.status_code != 202:
                log.info("checker %s refused session %s's receipt: %s %s", checker.node_id,
                         receipt.session_id[:8], answer.status_code, answer.text[:200])
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is skipped, never a session's problem
            log.info("spot check of session %s not sent: %s: %s", receipt.session_id[:8], type(exc).__name__, exc)

    # ---- checker and referee -----------------------------------------------------------------------------------

    async def _read(self, request: Request) -> tuple[SpotReceipt, list[bytes | None], list[bytes]]:
        body = await read_body(request.receive, dict(request.scope["headers"]), self._max_body)
        try:
            receipt, inputs, outputs = SpotReceipt.decode(body)
        except ValueError as exc:
            raise BadRequestError(str(exc)) from None
        if receipt.model_id != self.model_id or receipt.layers != self._backend.layers:
            raise BadRequestError(f"node {self.node_id} serves layers {self._backend.layers} of {self.model_id}, "
                                  f"not {receipt.layers} of {receipt.model_id}")
        if not receipt.frames or receipt.frames[0].start != 0:
            raise BadRequestError("a receipt starts at position 0")
        if self._running >= MAX_CHECKS:
            raise CapacityError(f"node {self.node_id} is running {self._running} spot checks already")
        return receipt, inputs, outputs

    async def _check(self, request: Request) -> Response:
        receipt, inputs, outputs = await self._read(request)
        self._running += 1
        self._spawn(self._run_check(receipt, inputs, outputs), f"spot-check-{receipt.session_id[:8]}")
        return JSONResponse({"accepted": True, "positions": receipt.positions}, status_code=202)

    async def _referee(self, request: Request) -> Response:
        receipt, inputs, outputs = await self._read(request)
        self._running += 1
        try:
            verdict = await self.recompute(receipt, inputs, outputs, role="referee")
        finally:
            self._running -= 1
        return JSONResponse(verdict.model_dump(mode="json"))

    async def _run_check(self, receipt: SpotReceipt, inputs: list[bytes | None], outputs: list[bytes]) -> None:
        try:
            verdict = await self.recompute(receipt, inputs, outputs, role="check")
        except Exception as exc:  # noqa: BLE001 - e.g. no free sequence: the check is skipped
            log.info("spot check of %s (session %s) skipped: %s", receipt.node_id, receipt.session_id[:8], exc)
            self._metrics.spot_checks.labels(role="check", outcome="skipped").inc()
            return
        finally:
            self._running -= 1
        if verdict.agree:
            return
        log.warning("spot check: node %s's layers %s of session %s disagree with %s's (first at position %s, "
                    "median rel err %.3g, top-k %.2f); asking a referee", receipt.node_id, receipt.layers,
                    receipt.session_id[:8], self.node_id, verdict.first_bad, verdict.median_rel_err,
                    verdict.median_top_k)
        try:
            await self._dispute(receipt, inputs, outputs, verdict)
        except Exception as exc:  # noqa: BLE001 - an unsettled dispute evicts nobody
            log.warning("dispute over session %s unsettled: %s: %s", receipt.session_id[:8], type(exc).__name__, exc)

    async def _dispute(self, receipt: SpotReceipt, inputs: list[bytes | None], outputs: list[bytes],
                       mine: SpotVerdict) -> None:
        referee = await self._ask_checker(CheckerRequest(model_id=receipt.model_id, layers=receipt.layers,
                                                         exclude=[receipt.node_id, self.node_id],
                                                         build_id=receipt.build_id, kernels_id=receipt.kernels_id,
                                                         role="referee"))
        if not referee.node_id:
            raise RuntimeError(f"no referee for layers {receipt.layers}: {referee.error}")
        answer = await self._client.post_receipt(referee.node_id, referee.endpoint, receipt.encode(inputs, outputs),
                                                 referee=True, timeout=POST_TIMEOUT_S * 6)
        if answer.status_code != 200:
            raise RuntimeError(f"referee {referee.node_id} answered {answer.status_code}: {answer.text[:200]}")
        theirs = SpotVerdict.model_validate(answer.json())
        reply = await self._report_dispute(Dispute(session_id=receipt.session_id, model_id=receipt.model_id,
                                                   layers=receipt.layers, checked=receipt.node_id, checker=mine,
                                                   referee=theirs, clearance=receipt.clearance))
        log.warning("dispute over session %s settled by %s: %s", receipt.session_id[:8], referee.node_id,
                    f"{reply.evicted} evicted" if reply.evicted else f"nobody evicted ({reply.reason})")

    async def recompute(self, receipt: SpotReceipt, inputs: list[bytes | None], outputs: list[bytes], *,
                        role: SpotRole) -> SpotVerdict:
        """Run the receipt's frames through this node's layers in a scratch session and compare."""
        shape = tuple(receipt.hidden_shape)
        if shape != tuple(self._backend.info.hidden_shape):
            raise BadRequestError(f"a receipt of hidden shape {list(shape)} for a node of "
                                  f"{self._backend.info.hidden_shape}")
        tail = receipt.top_k > 0
        if tail != self._backend.is_tail:
            raise BadRequestError(f"a {'tail' if tail else 'hop'}'s receipt for node {self.node_id}, which is "
                                  f"{'' if self._backend.is_tail else 'not '}a tail")
        try:
            claimed: list[Hidden] = [] if tail else [_array(out, f.n, shape)
                                                     for f, out in zip(receipt.frames, outputs, strict=True)]
            claimed_top = [top_of(out, receipt.top_k) for f, out in zip(receipt.frames, outputs, strict=True)
                           if tail and f.sample]
        except ValueError as exc:
            raise BadRequestError(str(exc)) from None
        sid = f"{SCRATCH_PREFIX}{uuid.uuid4().hex[:16]}"
        prompt = [t for f in receipt.frames for t in (f.tokens or [])]
        await self._engine.call(lambda: self._backend.open_session(sid, prompt_tokens=prompt,
                                                                   sampling=SamplingParams(temperature=0)))
        mine: list[Hidden] = []
        mine_top: list[TopLogits] = []
        sampled_at: list[int] = []
        alone = True
        clean = 0  # leading positions computed in passes of their own on both sides
        try:
            for frame, raw in zip(receipt.frames, inputs, strict=True):
                hidden = None if raw is None else _array(raw, frame.n, shape)
                if (hidden is None) == (frame.tokens is None):
                    raise BadRequestError(f"the frame at {frame.start} needs exactly one of tokens and hidden states")
                sample = tail and frame.sample
                out, timing = await self._engine.submit(StepInput(sid, frame.start, tokens=frame.tokens,
                                                                  hidden=hidden, sample=sample,
                                                                  top_k=receipt.top_k if sample else 0))
                alone = alone and frame.alone and timing.batch_size <= 1
                clean = frame.start + frame.n if alone else clean
                if tail:
                    if sample:
                        if out.top is None:
                            raise BadRequestError(f"node {self.node_id}'s backend returns no top logits")
                        mine_top.append(out.top)
                        sampled_at.append(frame.start + frame.n - 1)
                    continue
                if out.hidden is None:
                    raise BadRequestError(f"node {self.node_id} computes no hidden states")
                mine.append(np.array(out.hidden, dtype=np.float32, copy=True))
        finally:
            await self._engine.call(lambda: self._backend.close_session(sid))
        exact_rule = alone and bool(receipt.build_id) and receipt.build_id == self.build_id
        same_kernels = bool(receipt.kernels_id) and receipt.kernels_id == self.kernels_id
        if tail:
            verdict = compare_logits(claimed_top, mine_top, exact_rule=exact_rule, same_kernels=same_kernels,
                                     band=self._band, node_id=self.node_id, build_id=self.build_id,
                                     positions=sampled_at, clean=clean)
            if receipt.greedy:
                verdict = _with_draws(verdict, receipt, mine_top, sampled_at, exact_rule=exact_rule)
        else:
            verdict = compare(claimed, mine, exact_rule=exact_rule, same_kernels=same_kernels, band=self._band,
                              node_id=self.node_id, build_id=self.build_id, clean=clean)
        outcome = "disagree" if not verdict.agree else \
            "unjudged" if verdict.rule != "exact" and not verdict.judged else "agree"
        self._metrics.spot_checks.labels(role=role, outcome=outcome).inc()
        log.info("spot check (%s) of %s by %s, session %s: %d positions (%d judged), %s (%s rule, exact %s, "
                 "median rel err %.3g, max %.3g, median top-k %.2f)", role, receipt.node_id, self.node_id,
                 receipt.session_id[:8], verdict.positions, verdict.judged, "agree" if verdict.agree else "disagree",
                 verdict.rule, verdict.exact, verdict.median_rel_err, verdict.max_rel_err, verdict.median_top_k)
        return verdict


def _with_draws(verdict: SpotVerdict, receipt: SpotReceipt, mine: list[TopLogits], positions: list[int], *,
                exact_rule: bool) -> SpotVerdict:
    """A greedy tail's verdict, also disagreeing where it drew another token than the certain argmax."""
    drawn = [f.drawn for f in receipt.frames if f.sample]
    if len(drawn) != len(mine):
        return verdict
    bad = wrong_draw(drawn, mine, positions, exact_rule=exact_rule)
    if bad is None:
        return verdict
    first = bad if verdict.first_bad is None else min(bad, verdict.first_bad)
    return verdict.model_copy(update={"agree": False, "first_bad": first, "judged": max(verdict.judged, 1)})


def band_of(settings: Settings) -> Band:
    return Band(rel_tol=settings.spot_check_rel_tol, top_k=settings.spot_check_top_k,
                min_top_k=settings.spot_check_min_top_k, logit_rel_tol=settings.spot_check_logit_rel_tol,
                wide_rel_tol=settings.spot_check_wide_rel_tol,
                wide_logit_rel_tol=settings.spot_check_wide_logit_rel_tol)


def _array(raw: bytes, n: int, shape: tuple[int, ...]) -> Hidden:
    values = np.frombuffer(raw, dtype="<f4")
    want = n * int(np.prod(shape))
    if values.size != want:
        raise BadRequestError(f"a frame of {n} positions carries {values.size} values, not {want}")
    return values.reshape((n, *shape)).astype(np.float32)
