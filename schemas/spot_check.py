"""Spot checks and evictions (issue #28): the wire contracts between a checked node, its checker, a referee and the
trackers.

A *receipt* is what one hop of one session computed: the frames it was given (token ids on the head, hidden states
elsewhere) and the hidden states it sent on (on the tail: the largest logits of each row it sampled from), from
position 0, in the chunks it computed them in. Its arrays travel
beside the model, as raw little-endian float32 (``SpotReceipt.encode``), never as JSON.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgpack
from pydantic import Field

from schemas.base import WireModel, WirePart
from schemas.node import LayerRange


class SpotFrame(WirePart):
    """One frame of a receipt: positions ``[start, start + n)``."""

    start: int = Field(ge=0)
    n: int = Field(ge=1)
    tokens: list[int] | None = Field(default=None, description="the head's input; None on every other hop")
    alone: bool = Field(default=True, description="computed in a forward pass of its own (no other session's rows)")
    sample: bool = Field(default=False, description="a tail's frame that sampled a token: its output is the top "
                                                    "logits of its last position (a tail's other frames have none)")
    drawn: int | None = Field(default=None, description="a sampling frame's token: what the tail drew")


class SpotReceipt(WireModel):
    """What a checked hop computed, sent to its checker (and, on a disagreement, to a referee)."""

    session_id: str
    model_id: str
    manifest_id: str = ""
    layers: LayerRange
    node_id: str = Field(description="the checked node")
    build_id: str = Field(default="", description="the checked node's backend build (NodeAdvertisement.build_id)")
    kernels_id: str = Field(default="", description="its kernel family (actors.node.build_id.kernels_id): builds "
                                                    "that differ only in CPU features share it")
    hidden_shape: list[int]
    frames: list[SpotFrame]
    top_k: int = Field(default=0, ge=0, description="a tail's receipt: each sampling frame's output is the top_k "
                                                    "largest logits it sampled from (int32 ids, then float32 "
                                                    "values); 0: every frame's output is its hidden states")
    greedy: bool = Field(default=False, description=(
        "a tail's receipt of a session whose every draw is the argmax of the raw logits (temperature 0, no "
        "penalty, no constraint): the checker also checks each drawn token against its own logits"))
    clearance: int | None = Field(default=None, ge=0, description=(
        "how many times the checked node's operator had cleared an eviction of it when this session opened, as "
        "the node knew it (None: not known yet, e.g. before a restarted node's first checker reply). A dispute "
        "of work from before the latest clear evicts nobody: the operator vouched for what runs since"))

    @property
    def positions(self) -> int:
        return self.frames[-1].start + self.frames[-1].n if self.frames else 0

    def encode(self, inputs: list[bytes | None], outputs: list[bytes]) -> bytes:
        """The receipt with each frame's input (None on the head) and output as raw float32 bytes."""
        packed: bytes = msgpack.packb({"receipt": self.model_dump(mode="json"), "inputs": inputs,
                                       "outputs": outputs}, use_bin_type=True)
        return packed

    @classmethod
    def decode(cls, data: bytes) -> tuple[SpotReceipt, list[bytes | None], list[bytes]]:
        """``ValueError`` saying why when the body is not a receipt (the edge turns it into a 400)."""
        try:
            raw: Any = msgpack.unpackb(data, raw=False)
            receipt = cls.model_validate(raw["receipt"])
            inputs, outputs = list(raw["inputs"]), list(raw["outputs"])
        except Exception as exc:  # noqa: BLE001 - any malformed body is the sender's fault
            raise ValueError(f"not a spot-check receipt: {type(exc).__name__}: {exc}") from None
        if len(inputs) != len(receipt.frames) or len(outputs) != len(receipt.frames):
            raise ValueError(f"a receipt of {len(receipt.frames)} frames carries {len(inputs)} inputs and "
                             f"{len(outputs)} outputs")
        if any(o is not None and not isinstance(o, bytes) for o in [*inputs, *outputs]):
            raise ValueError("a receipt's arrays must be raw bytes")
        return receipt, inputs, outputs


class SpotVerdict(WirePart):
    """One recomputation of a receipt compared with what the checked node sent."""

    node_id: str = Field(description="who recomputed")
    build_id: str = ""
    agree: bool
    exact: bool = Field(description="every output bit-identical")
    rule: Literal["exact", "band", "wide"] = Field(
        description="exact: same build and every pass alone on both sides; band: same kernel family, "
                    "Settings.spot_check_rel_tol (the tail's: spot_check_logit_rel_tol) and the top-k overlap on the "
                    "clean positions (before the first pass that shared its batch on either side); wide: another "
                    "kernel family or no clean position, the spot_check_wide_* tolerances")
    positions: int = Field(ge=0, description="positions compared (the tail's: positions it sampled after)")
    judged: int = Field(default=0, ge=0, description="of them, the ones the rule judged (band: the clean ones)")
    max_rel_err: float = Field(ge=0, description="largest |a - b| / |b| (L2, per position) over every position")
    median_rel_err: float = Field(default=0.0, ge=0, description="the same at the median judged position: what the "
                                                                  "band judges")
    min_top_k: float = Field(ge=0, le=1, description="least overlap of the top-k components of one position")
    median_top_k: float = Field(default=1.0, ge=0, le=1, description="the overlap at the median position")
    first_bad: int | None = Field(default=None, description="the first position outside the rule, on a "
                                                            "disagreement")


SpotRole = Literal["check", "referee"]


class CheckerRequest(WireModel):
    """A node asks the trackers who recomputes a receipt: a node serving exactly ``layers`` of the model, not
    excluded and not evicted, preferring ``build_id``'s build, then ``kernels_id``'s kernel family."""

    model_id: str
    layers: LayerRange
    exclude: list[str] = Field(default_factory=list)
    build_id: str = ""
    kernels_id: str = ""
    """Preferred after ``build_id``: a checker of the same kernel family compares within the narrow band, which
    catches what the wide band across families lets through (another quantization such as Q8_0)."""
    role: SpotRole = "check"
    node_id: str = ""
    """Who asks (the checked node): the reply tells it its clearance generation."""


class CheckerReply(WireModel):
    node_id: str = ""
    endpoint: str = ""
    build_id: str = ""
    clearance: int | None = Field(default=None, ge=0, description="the asking node's clearance generation as the "
                                                                   "trackers know it (Eviction.clearance)")
    error: str = ""
    status: int = 200


class Dispute(WireModel):
    """A checker that disagreed with a receipt and had a referee recompute it reports both verdicts."""

    session_id: str
    model_id: str
    layers: LayerRange
    checked: str
    checker: SpotVerdict
    referee: SpotVerdict
    clearance: int | None = Field(default=None, ge=0, description="the receipt's SpotReceipt.clearance")


class Eviction(WireModel):
    """A node the trackers no longer route to, with the evidence: published on ``Subjects.evictions`` and kept in
    the evictions bucket until its operator clears it (``swarmroute evictions clear``)."""

    node_id: str
    model_id: str
    layers: LayerRange
    reason: str
    session_id: str = ""
    checker: SpotVerdict | None = None
    referee: SpotVerdict | None = None
    evicted_at: float = Field(default_factory=time.time)
    cleared: bool = Field(default=False, description="True on the note that an operator cleared it")
    clearance: int = Field(default=0, ge=0, description="how many times an operator has cleared the node: before "
                                                        "this eviction, or on a cleared note including this clear")


class DisputeReply(WireModel):
    evicted: str = Field(default="", description="the node evicted, empty when nobody was")
    reason: str = ""
    error: str = ""
    status: int = 200
