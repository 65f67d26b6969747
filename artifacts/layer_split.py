"""Split a model's layers into contiguous per-node ranges that fit each node's memory.

Nodes are taken in the order given (the route order: the first used node is the head, the last the tail). A node
holds its layers' weights, their caches for ``sessions`` sessions at ``context`` tokens, the head extras (token
embedding) if it starts at layer 0, and the tail extras (lm_head, MTP blocks) if it ends at the last layer.

Greedy filling, each node taking the longest allowed range that fits under ``fill x usable memory``, finds a split
whenever one exists (a longer prefix never makes the rest harder, since costs only grow with the range). ``balance``
then searches the smallest ``fill`` that still works, so memory use is spread in proportion to node size.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence

from artifacts.model_shape import ModelShape
from schemas.errors import BadRequestError, NoRouteError
from schemas.frame import WireDType

FRAME_FIXED_BYTES = 40
"""Fixed activation-frame header (bus/frame.py layout); each dim adds 4 bytes and each hop stamp 12."""
FRAME_DIM_BYTES = 4
FRAME_STAMP_BYTES = 12

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}
_SIZE = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


@dataclasses.dataclass(frozen=True, slots=True)
class NodeSpec:
    label: str
    memory_bytes: int


KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_0", "q4_0")
"""Cache types llama.cpp accepts for ``--cache-type-k/v``."""


def parse_nodes(specs: Sequence[str]) -> list[NodeSpec]:
    """``24GB``, ``4x24GB``, ``512MiB``... GB and GiB both mean 2^30: accelerator vendors' "24 GB" is binary."""
    nodes: list[NodeSpec] = []
    for spec in specs:
        for part in spec.split(","):
            m = _SIZE.match(part)
            unit = m.group(3).lower() if m else ""
            if m is None or unit not in _UNITS:
                raise BadRequestError(f"node size {part!r} is not like 24GB, 80GiB or 4x24GB")
            count, size = int(m.group(1) or 1), int(float(m.group(2)) * _UNITS[unit])
            if count < 1 or size < 1:
                raise BadRequestError(f"node size {part!r} must be positive")
            nodes += [NodeSpec(f"{m.group(2)}{m.group(3) or 'B'}", size) for _ in range(count)]
    if not nodes:
        raise BadRequestError("give at least one node (--node 24GB or --nodes 4x24GB)")
    return nodes


def parse_tokens(text: str) -> int:
    """``131072``, ``128K`` or ``1M`` (K = 1024 tokens, as context sizes are usually quoted)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if m is None:
        raise BadRequestError(f"context {text!r} is not like 131072, 128K or 1M")
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()]


@dataclasses.dataclass(frozen=True, slots=True)
class PlanSettings:
    context: int = 128 * 1024
    """Tokens of context each session may reach: the cache is sized for this."""
    sessions: int = 1
    """Concurrent sessions whose caches each node must hold."""
    kv_itemsize: float = 2.0
    """Bytes per cached value (f16 = 2; q8_0 = 34/32)."""
    reserve: float = 0.10
    """Fraction of each node's memory kept free for compute buffers, the runtime and the OS."""
    wire_dtype: WireDType = WireDType.F32
    balance: bool = True
    """Spread memory use across all nodes (True) or fill nodes in order and use as few as possible (False)."""
    split_groups: bool = False
    """Allow cutting hard groups whose state can travel (``carry_bytes`` > 0), as a last resort."""


@dataclasses.dataclass(frozen=True, slots=True)
class NodeAssignment:
    node: NodeSpec
    start: int
    end: int
    weight_bytes: int
    """Layer weights plus whatever head/tail/shared/MTP weights this node carries."""
    kv_bytes_per_token: float
    """Cache growth per token per session (windowed caches excluded: they stop growing)."""
    kv_bytes: int
    """Caches and fixed state for all sessions at the context cap."""
    roles: tuple[str, ...]
    usable_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def utilization(self) -> float:
        return self.total_bytes / self.node.memory_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    shape: ModelShape
    settings: PlanSettings
    assignments: tuple[NodeAssignment, ...]
    unused: tuple[NodeSpec, ...]
    hop_bytes: tuple[int, ...]
    """Bytes of one decode frame on each hop between consecutive nodes, hop stamps included."""
    warnings: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def cuts(self) -> tuple[int, ...]:
        return tuple(a.end for a in self.assignments[:-1])


class _Costs:
    """Memory a node needs for a layer range, with the head/tail extras the range implies."""

    def __init__(self, shape: ModelShape, settings: PlanSettings) -> None:
        self.shape, self.settings = shape, settings
        n = shape.n_layers
        self._w = [0] * (n + 1)
        self._kv = [0] * (n + 1)
        for i, layer in enumerate(shape.layers):
            self._w[i + 1] = self._w[i] + layer.weight_bytes
            self._kv[i + 1] = self._kv[i] + layer.kv_bytes(settings.context, settings.kv_itemsize)
        self._mtp_w = sum(m.weight_bytes for m in shape.mtp_layers)
        self._mtp_kv = sum(m.kv_bytes(settings.context, settings.kv_itemsize) for m in shape.mtp_layers)

    def weights(self, start: int, end: int) -> int:
        w = self._w[end] - self._w[start] + self.shape.shared_bytes
        if start == 0:
            w += self.shape.head_bytes
        if end == self.shape.n_layers:
            w += self.shape.tail_bytes + self._mtp_w
            if start != 0 and self.shape.tail_needs_embedding:
                w += self.shape.head_bytes
        return w

    def kv(self, start: int, end: int) -> int:
        kv = self._kv[end] - self._kv[start] + (self._mtp_kv if end == self.shape.n_layers else 0)
        return kv * self.settings.sessions

    def total(self, start: int, end: int) -> int:
        return self.weights(start, end) + self.kv(start, end)


def _greedy(costs: _Costs, nodes: Sequence[NodeSpec], cuts: Sequence[int], fill: float) -> list[tuple[int, int, int]]:
    """(node index, start, end) per used node, or [] when the layers do not fit; ``cuts`` are allowed boundaries."""
    n, start, out = costs.shape.n_layers, 0, []
    for i, node in enumerate(nodes):
        if start == n:
            break
        budget = fill * node.memory_bytes * (1 - costs.settings.reserve)
        ends = [c for c in cuts if c > start and costs.total(start, c) <= budget]
        if ends:
            out.append((i, start, ends[-1]))
            start = ends[-1]
    return out if start == n else []


def _cut_points(shape: ModelShape, soft: bool, carried: bool = True) -> list[int]:
    """Boundaries allowed when soft groups are (``soft``) and carryable hard groups are (``carried``) respected."""
    groups = [g for g in shape.groups if (g.hard and (carried or not g.carry_bytes)) or (soft and not g.hard)]
    return [c for c in range(1, shape.n_layers + 1) if not any(g.splits_at(c) for g in groups)]


def _search(costs: _Costs, nodes: Sequence[NodeSpec], cuts: Sequence[int]) -> list[tuple[int, int, int]]:
    best = _greedy(costs, nodes, cuts, 1.0)
    if not best or not costs.settings.balance:
        return best
    lo, hi = 0.0, 1.0
    for _ in range(40):  # bisection to ~1e-12 of capacity: far below one layer's bytes
        mid = (lo + hi) / 2
        found = _greedy(costs, nodes, cuts, mid)
        if found:
            hi, best = mid, found
        else:
            lo = mid
    return best


def split(shape: ModelShape, nodes: Sequence[NodeSpec], settings: PlanSettings) -> Plan:
    """Raises ``NoRouteError`` (with the numbers) when the nodes cannot hold the model."""
    costs = _Costs(shape, settings)
    warnings: list[str] = []
    found = _search(costs, nodes, _cut_points(shape, soft=True))
    if not found:
        found = _search(costs, nodes, _cut_points(shape, soft=False))
    if not found and settings.split_groups:
        found = _search(costs, nodes, _cut_points(shape, soft=False, carried=False))
    if not found:
        raise NoRouteError(_no_fit_message(costs, nodes), code="plan_does_not_fit")
    cuts = [end for _, _, end in found[:-1]]
    warnings += _cut_warnings(shape, cuts)
    if shape.context_length and settings.context > shape.context_length:
        warnings.append(f"context {settings.context} exceeds the model's trained context {shape.context_length}")
    assignments = tuple(_assignment(costs, nodes[i], start, end) for i, start, end in found)
    used = {i for i, _, _ in found}
    return Plan(shape=shape, settings=settings, assignments=assignments,
                unused=tuple(node for i, node in enumerate(nodes) if i not in used),
                hop_bytes=tuple(hop_bytes(shape.hop_shape, settings.wire_dtype, hop) + _carried(shape, cut)
                                for hop, cut in enumerate(cuts)),
                warnings=tuple(warnings), notes=tuple(_notes(shape, settings)) + shape.notes)


def range_costs(shape: ModelShape, settings: PlanSettings) -> Callable[[int, int], int]:
    """``cost(start, end)``: bytes a node needs to serve ``[start, end)`` (weights with the head/tail extras the range
    implies, plus the cache for ``settings``), the cost ``split`` sizes ranges by; for callers that place one node at
    a time (the tracker's layer assignment)."""
    return _Costs(shape, settings).total


def sessions_held(shape: ModelShape, start: int, end: int, memory_bytes: int, settings: PlanSettings) -> int:
    """Sessions whose caches at ``settings.context`` fit in ``memory_bytes`` beside the weights of ``[start, end)``
    (the planner's reserve kept free): a node's session count from its memory (issue #30). 0 when not even one."""
    costs = _Costs(shape, dataclasses.replace(settings, sessions=1))
    free = memory_bytes * (1.0 - settings.reserve) - costs.weights(start, end)
    per_session = costs.kv(start, end)
    if free <= 0:
        return 0
    return int(free // per_session) if per_session > 0 else 2**31 - 1


def cut_points(shape: ModelShape, *, soft: bool) -> list[int]:
    """Allowed range ends in ``(0, n_layers]``: with ``soft`` every group is kept whole, else only hard groups."""
    return _cut_points(shape, soft)


def hop_bytes(hop_shape: Sequence[int], dtype: WireDType, hop_index: int) -> int:
    """One decode position leaving hop ``hop_index``: header, dims, one stamp per hop so far, payload."""
    payload = math.prod(hop_shape) * dtype.itemsize
    return FRAME_FIXED_BYTES + FRAME_DIM_BYTES * len(hop_shape) + FRAME_STAMP_BYTES * (hop_index + 1) + payload


def _assignment(costs: _Costs, node: NodeSpec, start: int, end: int) -> NodeAssignment:
    shape, settings = costs.shape, costs.settings
    roles = tuple(r for r, on in (("head", start == 0), ("tail", end == shape.n_layers),
                                  ("mtp", end == shape.n_layers and bool(shape.mtp_layers))) if on)
    per_token = shape.kv_bytes_per_token(start, end, settings.kv_itemsize)
    if end == shape.n_layers:
        per_token += sum(m.kv_bytes_per_token(settings.kv_itemsize) for m in shape.mtp_layers)
    return NodeAssignment(node=node, start=start, end=end, weight_bytes=costs.weights(start, end),
                          kv_bytes_per_token=per_token, kv_bytes=costs.kv(start, end), roles=roles,
                          usable_bytes=int(node.memory_bytes * (1 - settings.reserve)))


def _carried(shape: ModelShape, cut: int) -> int:
    return sum(g.carry_bytes for g in shape.groups if g.hard and g.splits_at(cut))


def _cut_warnings(shape: ModelShape, cuts: Sequence[int]) -> list[str]:
    warnings = []
    for c in cuts:
        for g in (g for g in shape.groups if g.splits_at(c)):
            extra = f"; frames on this hop must also carry {g.carry_bytes} B per position" if g.hard else ""
            warnings.append(f"cut at layer {c} splits group [{g.start}, {g.end}): {g.reason}{extra}")
    return warnings


def _notes(shape: ModelShape, settings: PlanSettings) -> list[str]:
    notes: list[str] = []
    if shape.mtp_layers:
        notes.append(f"{len(shape.mtp_layers)} MTP/drafter block(s) placed on the tail node: they read the last "
                     "layer's output and the sampled token's embedding")
    return notes


def _no_fit_message(costs: _Costs, nodes: Sequence[NodeSpec]) -> str:
    shape, s = costs.shape, costs.settings
    need = costs.total(0, shape.n_layers)
    usable = sum(n.memory_bytes * (1 - s.reserve) for n in nodes)
    biggest = max(nodes, key=lambda n: n.memory_bytes)
    cuts = _cut_points(shape, soft=False, carried=not s.split_groups)
    largest_piece = max(costs.total(a, b) for a, b in zip([0, *cuts], cuts, strict=False))
    parts = [f"{shape.name} does not fit: it needs {gib(need)} GiB (weights {gib(costs.weights(0, shape.n_layers))}"
             f" + cache {gib(costs.kv(0, shape.n_layers))} for {s.sessions} session(s) at {s.context} tokens), the "
             f"{len(nodes)} node(s) offer {gib(usable)} GiB after keeping {s.reserve:.0%} free"]
    if largest_piece > biggest.memory_bytes * (1 - s.reserve):
        parts.append(f"a piece that cannot be split further needs {gib(largest_piece)} GiB, more than the biggest "
                     f"node ({biggest.label}) offers")
    else:
        more = _nodes_needed(costs, biggest)
        if more:
            parts.append(f"about {more} x {biggest.label} nodes would hold it")
    return "; ".join(parts)


def _nodes_needed(costs: _Costs, node: NodeSpec, limit: int = 4096) -> int | None:
    cuts = _cut_points(costs.shape, soft=False, carried=not costs.settings.split_groups)
    lo, hi = 1, limit
    if not _greedy(costs, [node] * hi, cuts, 1.0):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(costs, [node] * mid, cuts, 1.0):
            hi = mid
        else:
            lo = mid + 1
    return lo


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"
