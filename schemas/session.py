"""Route Session lifecycle and the messages that open, drive and end one."""

from __future__ import annotations

import builtins
import enum
from collections.abc import Callable
from typing import Literal

from pydantic import Field, field_validator, model_validator

from schemas.base import WireModel, WirePart
from schemas.constraint import OutputConstraint
from schemas.errors import BadRequestError, ContextLengthError
from schemas.reasoning import ReasoningStart
from schemas.route import Route
from schemas.snapshot import StandbyRef
from schemas.tools import ToolCallFormat, ToolSet

MAX_EPOCH = 15
"""A token frame carries its route's epoch in four bits: a session survives at most 15 repairs."""

CONTEXT_CAP = 131_072
"""The product's hard context cap (128K tokens), whatever a backend could do."""

MAX_TOP_LOGPROBS = 20
"""Most alternatives a token's logprobs may list (OpenAI's ``top_logprobs`` limit)."""

MAX_CHOICES = 128
"""Most choices one session may ask for (OpenAI's ``n`` limit); a route allows at most its nodes' ``max_sessions``."""


def _none(v: object) -> bool:
    return v is None


def _zero(v: object) -> bool:
    return v == 0


def _one(v: object) -> bool:
    return v == 1


def _empty(v: object) -> bool:
    return not v


class SessionPhase(enum.StrEnum):
    """[queued ->] routing -> prefill -> decode -> complete | failed | cancelled. The last three are terminal;
    ``repairing`` (issue #18) may come between prefill or decode and where the session goes on; ``queued`` (issue
    #30) is a request waiting at its gateway for capacity, before it has a route."""

    QUEUED = "queued"
    ROUTING = "routing"
    PREFILL = "prefill"
    DECODE = "decode"
    REPAIRING = "repairing"
    COMPLETE = "complete"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (SessionPhase.COMPLETE, SessionPhase.FAILED, SessionPhase.CANCELLED)


class SamplingParams(WireModel):
    """Sampling as llama.cpp supports it; temperature 0 means greedy."""

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    penalty_last_n: int = Field(default=64, ge=0)
    # Fields added for issue #19 leave the wire untouched when unused (``exclude_if``): an old node still reads a new
    # gateway's message, and the bytes of a plain request do not change.
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS, exclude_if=_none,
        description="None: no logprobs; 0: the sampled token's only; N: also the N most likely tokens")
    constraint: OutputConstraint | None = Field(
        default=None, exclude_if=_none, description="what the tail's grammar sampler enforces")
    reasoning: ReasoningStart | None = Field(
        default=None, exclude_if=_none,
        description="issue #27, set by the head with a constraint: where the reply starts relative to a think block "
                    "(its template and prompt tell); the tail's grammar then enforces the constraint after the block")
    batch_invariant: bool = Field(
        default=False, exclude_if=lambda v: not v,
        description="issue #31: every hop computes this session's rows in passes of their own, so its tokens do "
                    "not depend on what else the route computes (a node that cannot refuses the open)")

    @field_validator("seed")
    @classmethod
    def _seed_bits(cls, v: int | None) -> int | None:
        # OpenAI clients send any integer (negative, beyond 64 bits); every backend's RNG takes an unsigned 64-bit
        # seed (llama.cpp 32), so wrap it here instead of letting a backend fail on it (found by tests/test_fuzz.py).
        return None if v is None else v & 0xFFFF_FFFF_FFFF_FFFF


class Prompt(WireModel):
    """What the head tokenizes: raw text (completions) or chat messages (the head applies the chat template)."""

    text: str | None = None
    messages: list[dict[str, object]] | None = None
    add_generation_prompt: bool = True
    tools: ToolSet | None = Field(default=None, exclude_if=_none,
                                  description="messages only: tools the template (or the generic fallback) renders")


class TokenizeReply(WireModel):
    tokens: list[int]
    tool_format: ToolCallFormat | None = Field(
        default=None, exclude_if=_none,
        description="how the head asked the model to write tool calls (when the prompt had tools): the tail "
                    "constrains and the gateway parses that format")


class HopGrant(WireModel):
    """What the head needs to open one hop after it itself (``SessionOpen.downstream``): the tracker's grant for that
    hop, and the hop's standby grant (the route the head is sent carries neither)."""

    capability: str = Field(default="", exclude_if=_empty)
    standby: str = Field(default="", exclude_if=_empty, description="the grant for the hop's standby holder")


class SessionOpen(WireModel):
    """Sent to every hop; the head then drives prefill and decode.

    Every hop gets the whole route (it needs its successor, and the head needs every node for telemetry). The gateway
    sends it to the head with ``downstream`` (issue #20): the head tokenizes ``prompt`` if it was given no tokens,
    opens every hop after it in parallel with its own prefill, and answers once they all answered. Without
    ``downstream`` the hops after the head were opened already (by the gateway before issue #20, by a repair).
    """

    session_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    route: Route
    hop_index: int = Field(ge=0)
    prompt_tokens: list[int] = Field(default_factory=list,
                                     description="head: to embed; tail: for penalties and counts (at least one; the "
                                                 "head may be sent ``prompt`` instead)")
    max_tokens: int = Field(ge=1)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stop: list[str] = Field(default_factory=list, max_length=16)
    ignore_eos: bool = False
    prefill_chunk: int = Field(default=256, ge=1, le=8192)
    capability: str = Field(default="", description="this hop's signed grant from the route (the route itself is "
                                                     "sent with capabilities stripped)")
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, exclude_if=_one,
                   description="choices: every hop forks the prompt's KV into n sequences after prefill")
    # Issue #18 fields, off the wire when unused (an older node reads a plain open as before).
    snapshot_every: int = Field(default=0, ge=0, exclude_if=_zero,
                                description="snapshot the KV at the end of prefill and every this many decoded "
                                            "positions to the hop's standby (0: never)")
    repair: bool = Field(default=False, exclude_if=lambda v: not v,
                         description="the head repairs the route when a hop is lost (every hop keeps a journal)")
    epoch: int = Field(default=0, ge=0, le=MAX_EPOCH, exclude_if=_zero,
                       description="the route's repair count: token frames of an older epoch are stale")
    resume: Resume | None = Field(default=None, exclude_if=_none,
                                  description="this hop replaces a lost one: what it rebuilds first")
    speculate: Speculation | None = Field(default=None, exclude_if=_none,
                                          description="issue #20: the head decodes in verify windows")
    reuse_limit: int | None = Field(default=None, ge=0, exclude_if=_none,
                                    description="head: the most prompt positions its downstream hops can reuse "
                                                "(the least any of them reported when it opened)")
    # Issue #20, route setup off the first token's path: the head opens the rest of the route.
    prompt: Prompt | None = Field(default=None, exclude_if=_none,
                                  description="head: the prompt to tokenize first (no tools: their format is the "
                                              "gateway's to know before it opens), instead of ``prompt_tokens``")
    fit_max_tokens: bool = Field(default=False, exclude_if=lambda v: not v,
                                 description="head, with ``prompt``: ``max_tokens`` is a default, cut to the context "
                                             "the prompt leaves")
    downstream: list[HopGrant] | None = Field(default=None, exclude_if=_none,
                                              description="head: open hops 1.. itself with these grants, one per hop "
                                                          "after it in order, while its prefill starts")

    @model_validator(mode="after")
    def _has_a_prompt(self) -> SessionOpen:
        if not self.prompt_tokens and self.prompt is None:
            raise ValueError("prompt_tokens must not be empty")
        if self.prompt is not None and (self.hop_index != 0 or self.prompt.tools is not None):
            raise ValueError("only the head tokenizes a prompt in its open, and never one with tools")
        if self.downstream is not None and (self.hop_index != 0 or len(self.downstream) != len(self.route.hops) - 1):
            raise ValueError("downstream: the head's, one grant per hop after it")
        return self


def session_budget(n_prompt: int, max_tokens: int | None, *, default: int, context: int) -> int:
    """The tokens a session may generate: ``max_tokens``, or without one ``default`` cut to what the prompt leaves
    of ``context``; a 400 when the prompt is empty or the two do not fit (the gateway's and the head's same check)."""
    if n_prompt <= 0:
        raise BadRequestError("the prompt is empty after tokenization")
    if n_prompt >= context:
        raise ContextLengthError(f"the prompt has {n_prompt} tokens; this route's context is {context} tokens")
    budget = max_tokens or min(default, context - n_prompt)
    if n_prompt + budget > context:
        raise ContextLengthError(f"prompt ({n_prompt} tokens) + max_tokens ({budget}) = {n_prompt + budget} "
                                 f"exceeds the context of {context} tokens")
    return budget


class Speculation(WireModel):
    """A session decoded in verify windows (issue #20): every hop computes windows in their order and cuts its KV
    back where a window starts below it (rejected drafts); the tail judges each window."""

    source: str = Field(description="ngram | model: where the head's drafts come from")
    max_k: int = Field(ge=0, le=32)
    windows: int = Field(ge=1, le=8)


class SessionOpened(WireModel):
    session_id: str
    node_id: str
    prompt_tokens: int
    reused: int = Field(default=0, ge=0, exclude_if=_zero,
                        description="prompt positions this hop took from a kept session's KV (prefix reuse)")
    max_tokens: int | None = Field(default=None, ge=1, exclude_if=_none,
                                   description="head, opened with ``fit_max_tokens``: the budget it settled on")
    reasoning: ReasoningStart | None = Field(
        default=None, exclude_if=_none,
        description="head: where the reply starts relative to a think block, when the model's template marks "
                    "reasoning (``schemas.reasoning``; issue #27); None: plain text")


class Resume(WireModel):
    """What a hop opened to replace a lost one rebuilds before it computes anything new (issue #18)."""

    standby: StandbyRef | None = None
    """The node holding the lost hop's snapshot chain (None: nothing to import, the journal replays from 0)."""
    segments: list[str] = Field(default_factory=list, description="digests of the chain's segments to import, "
                                                                    "in order")
    start: int = Field(default=0, ge=0, description="the position the imported segments end at")
    quiet_below: int = Field(ge=0, description="frames starting before this are computed and kept, not forwarded "
                                               "(the next hop holds those positions already) or, on the tail, "
                                               "sampled (their tokens are known)")
    target: int = Field(ge=0, description="the position the upstream hop's journal replay ends at (a replacement "
                                          "head: the position its KV reaches before it sends a frame)")
    generated: list[int] = Field(default_factory=list, description="tail: the tokens sampled so far, replayed "
                                                                     "into its sampler and stop rules")
    telemetry_seq: int = Field(default=0, ge=0, exclude_if=_zero,
                               description="head (issue #31, a replacement for a lost head): the last telemetry seq "
                                           "the gateway saw; the replacement's snapshots go on after it")
    lost_node: str = Field(default="", exclude_if=lambda v: not v,
                           description="head (issue #31): the head it replaces, for telemetry")


FinishReason = Literal["stop", "length"]


class LogprobCandidate(WirePart):
    """One of the most likely tokens at a position: its id and logprob (from the tail), its bytes (from the head)."""

    token: int
    logprob: float
    bytes: list[int] | None = Field(default=None, exclude_if=_none)


class TokenLogprobs(WirePart):
    """The log-probabilities that travel with a sampled token.

    The tail computes them from the raw logits row the token was sampled from (log-softmax over the whole
    vocabulary, before penalties, temperature and grammar: what llama-cpp-python's ``logprobs`` and vLLM's default
    return) and sends ids and logprobs only; the head, which has the vocabulary and builds the gateway's
    ``TokenEvent`` off the per-token path, fills in ``bytes``. The gateway turns bytes into OpenAI's ``token`` text.
    """

    token: int
    logprob: float
    bytes: list[int] | None = Field(default=None, exclude_if=_none)
    top: list[LogprobCandidate] = Field(default_factory=list, description="most likely first; empty when only "
                                                                            "the sampled token's logprob was asked")

    def with_bytes(self, token_bytes: Callable[[int], builtins.bytes]) -> TokenLogprobs:
        """A copy with every token's bytes filled in from the vocabulary (the head's job)."""
        return TokenLogprobs.model_construct(
            token=self.token, logprob=self.logprob, bytes=list(token_bytes(self.token)),
            top=[LogprobCandidate.model_construct(token=c.token, logprob=c.logprob, bytes=list(token_bytes(c.token)))
                 for c in self.top])


class TokenEvent(WireModel):
    """A sampled token on its way back from the tail to the head, and from the head to the gateway (NATS).

    ``text`` is the new, complete UTF-8 text this token finishes (possibly empty while a character is incomplete,
    or while a stop string might still be forming). ``seq`` counts the tokens of choice ``index``.
    """

    type: Literal["token"] = "token"
    """The tag that tells it from a ``SessionEnd`` on the session's token subject."""
    session_id: str
    seq: int = Field(ge=0, description="0 for the first generated token; gaps mean a lost message")
    token: int
    text: str = ""
    finish_reason: FinishReason | None = None
    hop_timings: list[HopTiming] = Field(default_factory=list)
    index: int = Field(default=0, ge=0, lt=MAX_CHOICES, exclude_if=_zero, description="the choice (n > 1)")
    logprobs: TokenLogprobs | None = Field(default=None, exclude_if=_none)


class HopTiming(WireModel):
    """What one hop spent on one step, carried back along the ring."""

    node_id: str
    compute_ms: float
    queue_ms: float = 0.0


class FailureReason(WireModel):
    """Why a session failed: which node, in which phase, and what was observed."""

    node_id: str | None = None
    phase: SessionPhase
    kind: Literal["unreachable", "timeout", "http_error", "backend_error", "cancelled", "protocol", "internal"]
    message: str
    evicted: bool = Field(default=False, exclude_if=lambda v: not v,
                          description="the node was evicted for computing wrong (issue #28): a repair routes around "
                                      "it and never uses its snapshots")

    def describe(self) -> str:
        """One line for humans: who, when, how, what was seen."""
        who = f"node {self.node_id}" if self.node_id else "the route"
        return f"{who} failed during {self.phase.value} ({self.kind}): {self.message}"


class ChoiceEnd(WirePart):
    """How one choice of an n > 1 session ended."""

    index: int = Field(ge=0)
    finish_reason: FinishReason | None = None
    completion_tokens: int = Field(default=0, ge=0)


class SessionEnd(WireModel):
    """Published on the token subject when a session ends for any reason; the gateway stops reading then.

    With n > 1, ``completion_tokens`` counts every choice and ``choices`` says how each ended (its
    ``completion_tokens`` lets the gateway see a lost last token of any choice); ``finish_reason`` is choice 0's."""

    type: Literal["end"] = "end"
    """The tag that tells it from a ``TokenEvent`` on the session's token subject."""
    session_id: str
    phase: SessionPhase
    finish_reason: FinishReason | None = None
    failure: FailureReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    choices: list[ChoiceEnd] = Field(default_factory=list, exclude_if=_empty)


class RouteChanged(WireModel):
    """Published on the token subject when the head repaired the route (issue #18): from ``epoch`` on the session
    runs on ``route`` (capabilities stripped), so whoever frees the session frees it on the new hops."""

    type: Literal["route"] = "route"
    session_id: str
    epoch: int = Field(ge=1, le=MAX_EPOCH)
    route: Route


TokenEvent.model_rebuild()
SessionOpen.model_rebuild()

TOKEN_SUBJECT_MESSAGES: dict[str, type[TokenEvent] | type[SessionEnd] | type[RouteChanged]] = {
    "token": TokenEvent, "end": SessionEnd, "route": RouteChanged}
"""What ``<ns>.tokens.<session>`` carries, by ``type`` tag."""
