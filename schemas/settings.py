"""The one place that reads the environment (``SWARMROUTE_*``). Everything else receives a ``Settings``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.reasoning import ReasoningFormat


def _default_home() -> Path:
    return Path.home() / ".cache" / "swarmroute"


BatchInvariance = Literal["off", "request", "all"]
"""``Settings.llama_batch_invariant``."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWARMROUTE_", use_attribute_docstrings=True, extra="ignore")

    home: Path = Field(default_factory=_default_home)
    """Where prepared models, artifact stores and embedded NATS state live."""

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server(s) to join; comma-separated for a cluster."""

    nats_user: str | None = None
    """NATS user name, when the server requires one."""

    nats_password: SecretStr | None = None
    """NATS password; never logged."""

    nats_token: SecretStr | None = None
    """NATS token auth; never logged."""

    nats_creds: Path | None = None
    """NATS credentials file (JWT + nkey seed)."""

    namespace: str = Field(default="swarmroute", pattern=r"^[A-Za-z0-9_-]+$")
    """First token of every subject, so several deployments can share one NATS."""

    bind_host: str = "127.0.0.1"
    """Address servers listen on; loopback unless an operator opens it."""

    gateway_port: int = Field(default=8000, ge=0, le=65535)
    """Gateway HTTP port."""

    api_keys: list[SecretStr] = Field(default_factory=list)
    """Bearer keys the gateway accepts; empty means no authentication."""

    heartbeat_s: float = Field(default=2.0, gt=0)
    """How often nodes republish their advertisement."""

    registry_ttl_s: float = Field(default=6.0, gt=0)
    """A node missing heartbeats for this long leaves the registry."""

    hop_timeout_s: float = Field(default=10.0, gt=0)
    """Longest a hop may take to accept and compute one frame before the route is declared failed."""

    first_token_timeout_s: float = Field(default=120.0, gt=0)
    """Longest the gateway waits for prefill to produce the first token (long prompts on slow nodes)."""

    token_timeout_s: float = Field(default=15.0, gt=0)
    """Longest the gateway waits between two tokens before it declares the route stalled."""

    liveness_probe_s: float = Field(default=1.0, ge=0)
    """While a session is silent (no token, no telemetry) for this long, the gateway asks every hop whether it still
    holds the session, and again at growing intervals: a hop whose process died (connection refused) or that lost
    the session (restarted) fails it at once, naming the node, instead of after ``token_timeout_s``. 0 turns it
    off."""

    hop_spin_grace_s: float = Field(default=0.0, ge=0, le=1.0)
    """Opt-in: between decode steps a node busy-polls (yielding its CPU to anything runnable) until the session's
    next frame or token comes, or this long after it was due (e.g. 0.002). It saves an idle CPU's wake-up on every
    hop (~0.1 ms per link on a VM where wake-ups are expensive, nothing measurable elsewhere: tests/bench/
    bench_gguf_route.py) for a core that stays busy while the node decodes; nodes that share a machine lose more
    than they gain. 0, the default, turns polling off (actors/node/spin.py)."""

    session_idle_ttl_s: float = Field(default=120.0, gt=0)
    """A node frees a session's KV after this long without frames."""

    client_probe_s: float = Field(default=5.0, ge=0)
    """How often a session's head asks whether its client (the gateway relaying its tokens) still listens on NATS.
    After three answers in a row of "no one there" (a killed gateway) the head cancels the session
    and frees it on every hop, instead of generating to ``max_tokens`` for nobody. 0 turns the check off."""

    llama_amx: bool = False
    """Let llama.cpp put weights in ggml's AMX buffer type on CPUs that have AMX. Off by default: on some of them
    the first matrix multiply there crashes the node (docs/llamacpp-backend.md); CPU_REPACK stays on either way."""

    llama_batch_invariant: BatchInvariance = "off"
    """Which sessions' tokens on llama.cpp nodes do not depend on what else the node computes at the same time
    (issue #31): ``off`` (none: one unified KV cache, every step one batched pass), ``request`` (the requests that
    ask, with ``batch_invariant: true``; the node keeps one KV stream per sequence so that it can, and batches the
    rest) or ``all`` (``true``/``1`` also mean all). Each invariant session is computed in passes of its own: 4
    concurrent streams all invariant decode at about 0.6x the aggregate rate (docs/llamacpp-backend.md, "Batch
    invariance"), so it is off by default. On an ``off`` node a request that asks is refused (400). Every node of a
    route should agree: KV snapshots and reuse move only between nodes with per-sequence streams or only between
    nodes without."""

    @field_validator("llama_batch_invariant", mode="before")
    @classmethod
    def _invariance_words(cls, v: object) -> object:
        words = {"true": "all", "1": "all", "yes": "all", "false": "off", "0": "off", "no": "off"}
        if isinstance(v, bool):
            return "all" if v else "off"
        return words.get(v.strip().lower(), v.strip().lower()) if isinstance(v, str) else v

    prefill_chunk: int = Field(default=256, ge=1, le=8192)
    """Prompt tokens per prefill frame."""

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest HTTP request body the gateway accepts."""

    max_frame_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    """Largest activation frame a node accepts."""

    default_max_tokens: int = Field(default=512, ge=1)
    """max_tokens when the request gives none (bounded again by the context left)."""

    telemetry_interval_s: float = Field(default=0.1, gt=0)
    """Minimum spacing of telemetry snapshots during decode (phase changes are always sent)."""

    log_level: str = "info"

    # ---- hardening (issue #9): NATS roles, session capabilities, gateway concurrency --------------------------

    nats_inbox_prefix: str = Field(default="_INBOX", pattern=r"^[A-Za-z0-9_-]+$")
    """Prefix of this actor's reply subjects. Give each role its own (``_INBOX_gateway``...) so that, with the
    per-role permissions of deploy/nats/auth.conf, no role can read another role's replies (route replies carry
    session capabilities)."""

    swarm_secret: SecretStr | None = None
    """Shared by trackers and nodes: trackers sign per-hop session capabilities with it (HMAC-SHA256) and nodes
    refuse session requests that lack a valid one. Unset (and no Ed25519 keys): no capability checks. Never logged."""

    capability_signing_key: SecretStr | None = None
    """Trackers, instead of ``swarm_secret``: Ed25519 private key (base64 of the 32-byte seed), so nodes hold only
    the public key and cannot mint capabilities for each other. Never logged."""

    capability_verify_key: str | None = None
    """Nodes, with ``capability_signing_key`` on the trackers: the Ed25519 public key (base64, 32 bytes)."""

    capability_ttl_s: float = Field(default=30.0, gt=0)
    """How long a capability stays good for opening its session after the tracker issued it (the open session
    outlives it); also the clock skew tolerated between tracker and nodes."""

    gateway_max_sessions: int = Field(default=1024, ge=0)
    """Generation requests one gateway serves at once (streams included); beyond it 429. 0 means unlimited."""

    api_key_max_sessions: int = Field(default=0, ge=0)
    """Generation requests one API key may have in flight at once; beyond it 429. 0 means unlimited."""

    # ---- fleets and clusters (issue #8) -------------------------------------------------------------------------

    registry_replicas: int = Field(default=1, ge=1, le=5)
    """JetStream replicas of the node registry bucket when an actor creates it: 3 on a 3-server cluster, so the
    registry survives losing a server (an existing bucket keeps its replica count)."""

    nats_randomize: bool = True
    """Shuffle the NATS server list on connect (spreads clients over a cluster); false tries them in the given
    order, e.g. the server in this member's own rack first."""

    member_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]+$")
    """This process's name in its fleet (a node's is its node id): shown by $SRV discovery and ``fleet status``."""

    seed_upload_limit: int = Field(default=0, ge=0)
    """Bytes/s at most that each holder of a model's pieces (a node serving it from a local file or a fetched
    range, a seeder) uploads them to nodes joining with the model's id; 0 for no limit. A serving node seeds at a
    lower CPU priority than it decodes either way (docs/operations.md, "Every holder seeds"); ``--upload-limit``
    overrides it per process."""

    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On SIGTERM a node stops advertising and waits this long for its open sessions to finish before it stops
    (keep the container's grace period longer)."""

    route_retry_s: float = Field(default=1.0, ge=0)
    """With the admission queue off (``queue_max = 0``): how long the gateway keeps asking for a route while every
    route is full before it answers 429. With the queue on, the queue does the asking (``queue_poll_s``)."""

    # ---- Many users at once (issue #30): the gateway's admission queue ---------------------------------------

    queue_max: int = Field(default=256, ge=0)
    """Generation requests that may wait at one gateway for capacity (all models); beyond it 429 ``queue_full``.
    When it is full, a key with fewer requests waiting displaces the newest request of the key with the most, so
    one client's flood never keeps another key out. 0 turns the queue off: beyond capacity is a 429 at once (after
    ``route_retry_s``)."""

    queue_wait_s: float = Field(default=120.0, gt=0)
    """Longest a request waits in the queue; then 429 ``queue_timeout`` (an error chunk on a stream that already
    shows its ``queued`` position)."""

    queue_poll_s: float = Field(default=0.25, gt=0)
    """Longest the head of the queue waits before it asks for a route again while every route is full (it asks at
    once when a session on this gateway ends; capacity freed elsewhere is found by this poll)."""

    # ---- Prefix Snapshots (issue #18): repair after a node loss, and KV reuse across requests ----------------

    repair: bool = True
    """Repair a session that loses a route node (its head must survive): a replacement from the tracker rebuilds
    the lost KV from the latest snapshot and the upstream hop's journal, and decode goes on. False keeps alpha's
    fail-stop: the session fails, naming the node."""

    snapshot_every: int = Field(default=64, ge=0)
    """Every hop of a session snapshots its KV at the end of prefill and every this many decoded positions to its
    standby holder; 0 turns snapshots off (repair then replays the upstream hop's journal, or fails)."""

    snapshot_budget_mb: float = Field(default=256.0, ge=0)
    """Memory a node gives to holding other nodes' snapshots (it is their standby); 0 holds none."""

    repair_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a head waits for a replacement to appear (e.g. a supervisor restarting the lost node) and for the
    repair to finish, before the session fails."""

    max_repairs: int = Field(default=3, ge=0)
    """Node losses one session may survive."""

    prefix_cache_mb: float = Field(default=256.0, ge=0)
    """KV memory a node keeps for finished sessions so that a later request starting with the same tokens (the
    next turn of a chat, a shared system prompt) prefills only what is new; 0 turns prefix reuse off."""

    prefix_cache_sessions: int = Field(default=4, ge=0)
    """Most finished sessions a node keeps for reuse (llama.cpp: sequences beyond ``max_sessions``)."""

    prefix_reuse: str = Field(default="chunk", pattern=r"^(token|chunk)$")
    """``token`` (issue #26): a new session reuses the longest common token prefix, down to the token, and llama.cpp
    keeps finished sessions' KV resident in its context; ``chunk`` (issue #18): whole prefill chunks only, from host
    memory, so the rest computes in the very chunks, and cells, a cold run's does: bit for bit on llama.cpp's unified
    cache, where a parked prefix's cells (or a prompt's last tokens computed as a short batch) move a session's
    logits by up to ~1 (docs/architecture.md, "Prefix reuse")."""

    # ---- Hide the network (issue #20): speculative decoding across the route -----------------------------------

    speculation: str = Field(default="off", pattern=r"^(off|ngram|model)$")
    """Where a route's head gets draft tokens to verify k+1 positions per ring: ``ngram`` (prompt lookup, no extra
    model), ``model`` (``draft_model``), or ``off``. Windows compute several positions in one forward pass, which
    rounds differently from one at a time: greedy output can then differ from plain decoding at near-ties."""

    draft_model: Path | None = None
    """A small GGUF with the served model's vocabulary, for ``speculation = model`` (the head loads it)."""

    speculative_max_k: int = Field(default=8, ge=0, le=32)
    """Most drafts in one window; the head sizes each window from the acceptance and ring time it measures."""

    speculative_windows: int = Field(default=2, ge=1, le=8)
    """Most windows in flight: the next one starts, on the assumption that the one before is accepted whole, while
    that one is still going round the ring (when the measured acceptance makes it likely to pay)."""

    ring_groups: int = Field(default=0, ge=0, le=64)
    """A head's concurrent decode sessions on a route of several hops: 0 measures whether one forward pass for all
    of them or groups that follow each other around the ring (different hops computing different sessions at the
    same time) decode faster, and keeps the faster; 1 always puts them in one pass; k splits them into up to k
    groups (issue #20)."""

    # ---- Gateway loss (issue #31): background responses retained in JetStream ----------------------------------

    responses_retention_s: float = Field(default=600.0, gt=0)
    """How long a background response (``POST /v1/responses`` with ``background: true``) stays retrievable and
    resumable after its session's last event: its events live in a JetStream stream of their own, which any
    gateway replays (``GET /v1/responses/{id}?stream=true&starting_after=N``); past the window it is a 404."""

    responses_replicas: int = Field(default=1, ge=1, le=5)
    """JetStream replicas of each background response's stream: 3 on a 3-server cluster, so a response survives
    losing a NATS server as well as its gateway."""

    # ---- Reasoning apart from the answer (issue #27) -----------------------------------------------------------

    reasoning_format: ReasoningFormat = "auto"
    """llama-server's ``--reasoning-format`` for chat replies of models whose template marks reasoning: ``auto`` and
    ``deepseek`` stream the think block as ``reasoning_content``, ``deepseek-legacy`` keeps it inline in ``content``
    (a whole reply also gets ``reasoning_content``), ``none`` leaves it unparsed. A request's ``reasoning_format``
    overrides it (``schemas.reasoning``)."""
