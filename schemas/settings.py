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

    up_measure_cores: bool = True
    """``swarmroute up`` measures on this CPU whether its local llama.cpp nodes decode faster splitting the cores or
    each with every core and OpenMP's passive wait (``swarmroute.core_share``); False: the equal share, unmeasured."""

    core_share_cache: Path = Field(default_factory=lambda: _default_home() / "core-share.json")
    """Where those measurements are kept, per CPU, model file and llama.cpp version (outside ``home``: a machine's
    CPU does not change with the deployment)."""

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

    frame_batch: bool = False
    """Opt-in (issue #26): a node sends the decode frames and token frames it has for one peer in one turn of its
    loop as one request (``POST /v1/batch``, docs/protocol.md), instead of one request per session: concurrent
    sessions on a route then cost one request per pass per hop. Every node of a route must be of a version that
    serves ``/v1/batch`` (a lone frame still goes as before). Off: measured no faster on one shared 2-core machine
    (docs/operations.md, "Frame batches")."""

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

    seed_upload_limit: int = Field(default=20_000_000, ge=0)
    """Bytes/s at most that a serving node (from a local file or a fetched range) uploads the model's pieces it holds
    to nodes joining with the model's id; 0 for no limit. Its uploads share the CPU with its decoding: on a 2-core
    AMD EPYC a 1-thread node decoded at 0.83x its idle rate while seeding unlimited (~115 MB/s over loopback), and at
    0.98x within 25 MB/s or 10 MB/s (tests/bench/bench_seed_while_serving.py, docs/operations.md, "Every holder
    seeds"). ``--upload-limit`` overrides it per process."""

    seeder_upload_limit: int = Field(default=0, ge=0)
    """Bytes/s at most that a ``swarmroute seeder`` uploads; 0 (the default) for no limit: a seeder decodes nothing,
    so nothing of its own is slowed by its uploads. ``--upload-limit`` overrides it per process."""

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

    prefix_reuse: str = Field(default="token", pattern=r"^(token|chunk)$")
    """``token`` (issue #26, the default): a new session reuses the longest common token prefix, down to the token,
    and llama.cpp keeps finished sessions' KV resident in its context, as llama-server's ``cache_prompt`` does;
    ``chunk`` (issue #18): whole prefill chunks only, from host memory, so the rest computes in the very chunks,
    and cells, a cold run's does. On llama.cpp's unified cache a parked prefix's cells, and a prompt's last tokens
    computed as a short batch, round differently from a cold run (logits move by up to ~1, docs/architecture.md,
    "Prefix reuse"): like llama-server with ``cache_prompt``, greedy text can then differ from a cold run's at a
    near-tie. A batch-invariant session (issue #31: ``llama_batch_invariant = all``, or a request that asks with
    ``batch_invariant: true``) always reuses as ``chunk`` does, so its tokens are a cold run's, bit for bit."""

    prefill_subchunks: int = Field(default=1, ge=1, le=16)
    """A route's prompt that is one prefill chunk (a short prompt) is computed in up to this many sub-chunks, one
    per hop at most, so that each hop computes the next while the one after it computes the last (issue #26); 1
    (the default) computes it in one step on each hop, one hop after the other. Sub-chunks round differently from
    the whole step in ggml's kernels, so greedy text can change at near-ties (docs/architecture.md)."""

    prefix_pull: str = Field(default="auto", pattern=r"^(auto|never|always)$")
    """Prefixes across routes (issue #26): a hop whose route lacks a prompt's prefix pulls it from a node of the same
    layers that kept it when that is cheaper than computing it (``auto``: from the link rate and the hop's prefill
    rate it measured), or always computes it (``never``), or always pulls (``always``)."""

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

    # ---- A data plane safe on public networks (issue #29) ------------------------------------------------------

    tls: Literal["auto", "on", "off"] = "auto"
    """Node data plane over mutually authenticated TLS 1.3: ``auto`` serves TLS when the node listens on anything
    but loopback, ``on`` always, ``off`` never (a warning names what a non-loopback listener then exposes). Clients
    (nodes, gateways) speak TLS to every ``https://`` endpoint whatever this says, unless it is ``off``."""

    tls_cert_file: Path | None = None
    """This process's data-plane certificate (PEM), with ``tls_key_file``: given by the fleet file or signed by the
    fleet's CA. Unset: a self-signed one for a key created on first start under ``home``/identity (0600)."""

    tls_key_file: Path | None = None
    """The private key of ``tls_cert_file`` (PEM); never logged."""

    tls_ca_file: Path | None = None
    """A fleet's own CA (PEM): node servers accept any certificate it issued, clients require it of servers (the
    endpoint's pin is still checked). Unset: keys are trusted only as the registry names them."""

    tls_trusted_certs: Path | None = None
    """Node servers: certificates (PEM, concatenated) of the gateways they accept connections from. Gateways are
    not in the registry; their keys are named here (the fleet file writes it)."""

    nats_tls_ca_file: Path | None = None
    """CA (PEM) that signed the NATS servers' certificate: connect with ``tls://`` and verify it."""

    nats_tls_cert_file: Path | None = None
    """Client certificate (PEM) for NATS servers that verify clients (``tls { verify: true }``)."""

    nats_tls_key_file: Path | None = None
    """Key of ``nats_tls_cert_file``."""

    gateway_tls_cert_file: Path | None = None
    """Serve the gateway's OpenAI API over HTTPS with this certificate (PEM), for when no Ingress is in front."""

    gateway_tls_key_file: Path | None = None
    """Key of ``gateway_tls_cert_file``."""
    # ---- Spot checks and eviction (issue #28) ------------------------------------------------------------------

    spot_check_rate: float = Field(default=0.05, ge=0.0, le=1.0)
    """The fraction of sessions each hop records a receipt for (its input and output frames from position 0 to
    ``spot_check_positions``, prefill chunks and decode steps alike; the tail's outputs are the top logits of the
    rows it sampled from); another node serving the same layers recomputes it off the session's path
    (docs/reliability.md, "Spot checks"). 0 turns checks off."""

    spot_check_positions: int = Field(default=96, ge=1)
    """How many positions one receipt covers from position 0 (the frame that crosses it is the last one): a
    checker recomputes all of them, so this bounds a check's cost."""

    spot_check_rel_tol: float = Field(default=1e-4, gt=0.0)
    """The band between nodes of one kernel family (``kernels_id``: same llama.cpp and CPU buffer types, any CPU
    features) when they are not bit-identical: a receipt agrees when, at its median *clean* position (before the
    first pass that shared its batch, on either side), the L2 distance of the two boundary states is at most this
    fraction of the checker's norm and ``spot_check_min_top_k`` of their top ``spot_check_top_k`` components are the
    same. Measured on the bundled model (tests/bench/bench_spot_checks.py, docs/reliability.md §7): an AVX2 build
    against an AVX-512 one at most 1.0e-6 per position; Q8_0 1.6e-2 at the median (1.6e-3 at the least)."""

    spot_check_top_k: int = Field(default=32, ge=1)
    """How many of the largest-magnitude components of a boundary state (the tail: the largest logits) the bands
    compare."""

    spot_check_min_top_k: float = Field(default=0.75, ge=0.0, le=1.0)
    """The least overlap of the two top-k sets at the median judged position for a receipt to agree."""

    spot_check_logit_rel_tol: float = Field(default=1e-2, gt=0.0)
    """The tail's band within one kernel family: a tail's receipt (the ``spot_check_top_k`` largest logits of each
    row it sampled from) agrees when, at its median clean sampled position, the logits of the ids both top-k sets
    hold are within this fraction (L2) of the checker's and ``spot_check_min_top_k`` of the checker's ids are among
    the receipt's. Measured: AVX2 against AVX-512 0 at the median; Q8_0 3.7e-2."""

    spot_check_wide_rel_tol: float = Field(default=5e-2, gt=0.0)
    """The band across kernel families (plain against repacked kernels: 1.5e-2 at the median, measured, as far as
    Q8_0), or for a receipt with no clean position (honest load noise stays in the KV: up to 2.4e-2). Catches what
    is grossly wrong (Q4_0 1.1e-1, skipped layers 0.83); not Q8_0."""

    spot_check_wide_logit_rel_tol: float = Field(default=4e-2, gt=0.0)
    """The tail's wide band, across kernel families (plain kernels 0.7e-2 to 1.5e-2 at the median; Q4_0 7e-2 to
    1.5e-1). A tail's receipt with no clean sampled position is not judged: honest load noise reaches 8e-2 at single
    positions."""

    test_misbehave: str = Field(default="", pattern=r"^(|noise:[0-9.eE+-]+|skip|draw|quant:.+)$")
    """TEST ONLY (issue #28): make this node compute wrong while advertising honest work, to test spot checks
    against: ``noise:SIGMA`` adds Gaussian noise of that standard deviation to every hidden state it sends,
    ``skip`` sends its input on unchanged (skips its layers; not on a head), ``draw`` (a tail) computes right and
    draws the runner-up token, ``quant:PATH`` computes with the weights of another quantization of the same model
    while advertising the original. A node started with it logs an error at start; never set it in production."""
