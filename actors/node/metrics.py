"""Prometheus metrics of a node, served at ``GET /metrics`` on the node's HTTP API.

Each ``NodeMetrics`` has its own registry, so several nodes in one process (tests) keep separate series. The
artifact plane's byte counters are per process instead (one torrent session serves every shard of a process):
its code calls ``count_artifact_fetched`` / ``count_artifact_served``, and every node of the process exposes them.

Series (all names prefixed ``swarmroute_``)::

    node_sessions_opened_total{role}          head | middle | tail | whole
    node_sessions_ended_total{outcome}        head only: complete | failed | cancelled (its client went away)
    node_live_sessions                        sessions holding KV now
    node_max_sessions                         KV slots
    node_kv_bytes                             KV memory in use (backend's count)
    node_step_seconds{kind}                   backend compute of one step (prefill chunk / decode position)
    node_queue_seconds                        wait for the backend worker before a step ran
    node_pass_steps                           steps (of as many sessions) one forward pass carried
    node_hop_seconds{peer,kind}               sending a frame (or token) to the next hop until it answered;
                                              a hop answers after computing, so this is link + peer compute
    node_link_overhead_seconds                head: per-link cost of a decode step, (wall - compute) / links
    node_ttft_seconds                         head: session start to first sampled token
    node_time_per_output_token_seconds        head: one decode step around the ring
    node_frame_bytes_received_total           activation bytes received from the previous hop
    node_data_requests_total                  per-token-path requests this node wrote (frames, tokens, verdicts;
                                              a frame batch counts once, issue #26)
    node_data_frames_total                    frames and tokens those requests carried (frames per request: the
                                              ratio of the two)
    node_hop_spin_seconds_total               event-loop polling around expected decode messages (actors/node/spin.py)
    node_snapshot_bytes_total                 KV bytes of snapshot segments sent to standby holders (issue #18)
    node_snapshot_failures_total              snapshot segments a standby did not take (the chain restarts)
    node_snapshots_held_bytes                 bytes of other nodes' snapshots held here as their standby
    node_repairs_total{outcome}               head: route repairs, repaired | failed (issue #18)
    node_spot_checks_total{role,outcome}      spot checks (issue #28): checked submitted | no_checker; check or
                                              referee agree | disagree | skipped | unjudged (a tail receipt with no
                                              clean position)
    node_evicted_info{node,layers,rule,median_rel_err,median_top_k}
                                              1 per node the trackers evicted, with the checker's evidence
    node_prefix_reused_positions_total        prompt positions taken from kept KV instead of computed
    node_prefix_cache_sessions                finished sessions whose KV is kept for reuse
    node_prefill_positions_total              prompt positions this node computed (prefill chunks; reused ones are
                                              not: with reuse, the new tokens only, issue #26)
    node_prefix_rejected_total                kept prefixes that failed their hashes (dropped and recomputed)
    node_prefix_pulled_positions_total        prompt positions pulled from a node of another route (issue #26)
    node_spec_windows_total{source}           head: verify windows sent, by draft source (issue #20)
    node_spec_drafts_total{source,outcome}    head: drafts the tail judged, accepted | rejected; the acceptance
                                              rate is accepted / (accepted + rejected)
    node_spec_accepted_drafts{source}         head: drafts accepted per judged window (its mean: the mean
                                              accepted length, ``_sum / _count``)
    node_spec_windows_in_flight               head: verify windows sent and not yet judged, all sessions
    artifact_bytes_fetched_total{model}       artifact bytes downloaded by this process
    artifact_bytes_served_total{model}        artifact bytes uploaded to peers by this process
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from schemas.session import HopTiming


class InFlight(Protocol):
    """A speculative decode, as the windows-in-flight gauge reads it."""

    def windows_in_flight(self) -> int: ...


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Per-step and per-hop times: sub-millisecond loopback links up to multi-second prefill chunks."""
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Time to first token: includes prefill of long prompts."""

_ARTIFACTS = CollectorRegistry(auto_describe=True)
_FETCHED = Counter("swarmroute_artifact_bytes_fetched", "Model artifact bytes downloaded by this process",
                   ["model"], registry=_ARTIFACTS)
_SERVED = Counter("swarmroute_artifact_bytes_served", "Model artifact bytes uploaded to peers by this process",
                  ["model"], registry=_ARTIFACTS)


def count_artifact_fetched(nbytes: int, model_id: str = "") -> None:
    """The artifact plane calls this with each chunk of payload bytes it downloads (deltas, not totals)."""
    if nbytes > 0:
        _FETCHED.labels(model=model_id).inc(nbytes)


def count_artifact_served(nbytes: int, model_id: str = "") -> None:
    """The artifact plane calls this with each chunk of payload bytes it uploads to a peer (deltas, not totals)."""
    if nbytes > 0:
        _SERVED.labels(model=model_id).inc(nbytes)


class _DataPlane:
    """The per-token path's request and frame counts, read from the node's client at scrape time (``bus`` keeps
    the counts; it knows nothing of Prometheus)."""

    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        requests, frames = self._read()
        yield CounterMetricFamily("swarmroute_node_data_requests", "Per-token-path requests written (frames, tokens, "
                                  "verdicts; a frame batch counts once)", value=requests)
        yield CounterMetricFamily("swarmroute_node_data_frames", "Frames and tokens the per-token-path requests "
                                  "carried", value=frames)


class NodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.sessions_opened = Counter("swarmroute_node_sessions_opened", "Route Sessions opened on this node",
                                       ["role"], registry=r)
        self.sessions_ended = Counter("swarmroute_node_sessions_ended", "Route Sessions this node drove as head, "
                                      "by outcome", ["outcome"], registry=r)
        self.live_sessions = Gauge("swarmroute_node_live_sessions", "Sessions holding KV on this node", registry=r)
        self.max_sessions = Gauge("swarmroute_node_max_sessions", "KV slots of this node", registry=r)
        self.kv_bytes = Gauge("swarmroute_node_kv_bytes", "KV memory in use", registry=r)
        self.step_seconds = Histogram("swarmroute_node_step_seconds", "Backend compute of one step",
                                      ["kind"], buckets=_FAST, registry=r)
        self.pass_steps = Histogram("swarmroute_node_pass_steps", "Steps (of as many sessions) in one forward pass",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.queue_seconds = Histogram("swarmroute_node_queue_seconds", "Wait for the backend worker", buckets=_FAST,
                                       registry=r)
        self.hop_seconds = Histogram("swarmroute_node_hop_seconds", "Send to the next hop until it answered "
                                     "(link + the peer's compute)", ["peer", "kind"], buckets=_FAST, registry=r)
        self.link_overhead = Histogram("swarmroute_node_link_overhead_seconds", "Head: per-link overhead of a "
                                       "decode step", buckets=_FAST, registry=r)
        self.ttft = Histogram("swarmroute_node_ttft_seconds", "Head: session start to first token", buckets=_SLOW,
                              registry=r)
        self.tpot = Histogram("swarmroute_node_time_per_output_token_seconds", "Head: one decode step around the "
                              "ring", buckets=_FAST, registry=r)
        self.frame_bytes = Counter("swarmroute_node_frame_bytes_received", "Activation bytes received", registry=r)
        self.spin_seconds = Counter("swarmroute_node_hop_spin_seconds", "Event-loop polling around expected decode "
                                    "frames and tokens", registry=r)
        self.snapshot_bytes = Counter("swarmroute_node_snapshot_bytes", "KV bytes of snapshot segments sent to "
                                      "standby holders", registry=r)
        self.snapshot_failures = Counter("swarmroute_node_snapshot_failures", "Snapshot segments a standby did "
                                         "not take", registry=r)
        self.snapshots_held = Gauge("swarmroute_node_snapshots_held_bytes", "Bytes of other nodes' snapshots held "
                                    "here", registry=r)
        self.repairs = Counter("swarmroute_node_repairs", "Head: route repairs by outcome", ["outcome"], registry=r)
        self.spot_checks = Counter("swarmroute_node_spot_checks", "Spot checks by role and outcome (issue #28)",
                                   ["role", "outcome"], registry=r)
        self.evicted = Gauge("swarmroute_node_evicted_info", "Nodes the trackers evicted, with the evidence",
                             ["node", "layers", "rule", "median_rel_err", "median_top_k"], registry=r)
        self.prefix_reused = Counter("swarmroute_node_prefix_reused_positions", "Prompt positions taken from kept "
                                     "KV instead of computed", registry=r)
        self.spec_windows = Counter("swarmroute_node_spec_windows", "Head: verify windows sent (issue #20)",
                                    ["source"], registry=r)
        self.spec_drafts = Counter("swarmroute_node_spec_drafts", "Head: draft tokens the tail judged, by outcome",
                                   ["source", "outcome"], registry=r)
        self.spec_accepted = Histogram("swarmroute_node_spec_accepted_drafts", "Head: drafts accepted per judged "
                                       "window", ["source"], buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.spec_in_flight = Gauge("swarmroute_node_spec_windows_in_flight", "Head: verify windows sent and not "
                                    "yet judged", registry=r)
        self._speculating: set[InFlight] = set()
        self.spec_in_flight.set_function(lambda: float(sum(s.windows_in_flight() for s in self._speculating)))
        self.prefill_positions = Counter("swarmroute_node_prefill_positions", "Prompt positions computed in "
                                         "prefill chunks", registry=r)
        self.prefix_rejected = Counter("swarmroute_node_prefix_rejected", "Kept prefixes that failed their hashes",
                                       registry=r)
        self.prefix_pulled = Counter("swarmroute_node_prefix_pulled_positions", "Prompt positions pulled from a "
                                     "node of another route instead of computed (issue #26)", registry=r)
        self.prefix_cache_sessions = Gauge("swarmroute_node_prefix_cache_sessions", "Finished sessions whose KV "
                                           "is kept for reuse", registry=r)

    def bind(self, *, live_sessions: Callable[[], int], max_sessions: Callable[[], int],
             kv_bytes: Callable[[], int]) -> None:
        """Gauges read at scrape time (in the event loop, like the heartbeat that reads the same values)."""
        self.live_sessions.set_function(lambda: float(live_sessions()))
        self.max_sessions.set_function(lambda: float(max_sessions()))
        self.kv_bytes.set_function(lambda: float(kv_bytes()))

    def bind_data_plane(self, read: Callable[[], tuple[int, int]]) -> None:
        """Expose the client's (requests, frames) counts (``bus.nodeclient.NodeClient.data_plane``)."""
        self.registry.register(_DataPlane(read))

    def speculating(self, decoder: InFlight, live: bool) -> None:
        """A session's speculative decode started (``live``) or ended: its windows count towards the gauge."""
        if live:
            self._speculating.add(decoder)
        else:
            self._speculating.discard(decoder)

    def session_opened(self, hop_index: int, n_hops: int) -> None:
        role = "whole" if n_hops == 1 else "head" if hop_index == 0 else "tail" if hop_index == n_hops - 1 else "middle"
        self.sessions_opened.labels(role=role).inc()

    def prefill_totals(self) -> tuple[float, float]:
        """(prompt positions computed, seconds of prefill steps) so far: the node's prefill rate (issue #26)."""
        positions = seconds = 0.0
        for metric in (*self.prefill_positions.collect(), *self.step_seconds.collect()):
            for sample in metric.samples:
                if sample.name == "swarmroute_node_prefill_positions_total":
                    positions = sample.value
                elif sample.name == "swarmroute_node_step_seconds_sum" and sample.labels.get("kind") == "prefill":
                    seconds = sample.value
        return positions, seconds

    def step(self, kind: str, compute_ms: float, queue_ms: float) -> None:
        self.step_seconds.labels(kind=kind).observe(compute_ms / 1e3)
        self.queue_seconds.observe(queue_ms / 1e3)

    def hop(self, peer: str, kind: str, seconds: float) -> None:
        self.hop_seconds.labels(peer=peer, kind=kind).observe(seconds)

    def token(self, generated: int, ttft_ms: float | None, step_wall_ms: float | None,
              timings: Sequence[HopTiming], n_hops: int) -> None:
        """Head, after each token: the first gives TTFT, the others a decode step and its per-link overhead."""
        if generated == 1 and ttft_ms is not None:
            self.ttft.observe(ttft_ms / 1e3)
        if step_wall_ms is None:
            return
        self.tpot.observe(step_wall_ms / 1e3)
        if n_hops > 1:
            compute = sum(t.compute_ms + t.queue_ms for t in timings)
            self.link_overhead.observe(max(0.0, step_wall_ms - compute) / n_hops / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(_ARTIFACTS)
