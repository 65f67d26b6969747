"""Errors that cross actor boundaries, each carrying its HTTP status and OpenAI error type.

The one mapping in each direction lives here: ``SwarmrouteError.to_body`` / ``http_headers`` (error -> response,
used by the gateway's and the node's HTTP edge, ``bus.http_edge``) and ``error_from_body`` / ``error_for_status``
(a peer's response -> error, used by every HTTP client of ours)::

    SwarmrouteError (500, server_error)
    ├── BadRequestError (400, invalid_request_error)
    │   ├── ContextLengthError       prompt + max_tokens exceed the context
    │   ├── FrameError               activation frame with wrong size, dtype, position or session
    │   ├── StaleEpochError          a frame, route update or replay of an older route epoch: its sender was
    │   │                            routed around (a repair, an eviction)
    │   └── SnapshotError            a KV snapshot that fails its hash or belongs to another model, range or session
    ├── AuthenticationError (401)
    │   └── CapabilityError          session capability missing, forged or expired (node API)
    ├── PermissionDeniedError (403)  a valid capability, but not for this node, hop, session or route
    ├── NotFoundError (404)
    │   ├── ModelNotFoundError
    │   └── SessionNotFoundError
    ├── MethodNotAllowedError (405, Allow)
    ├── PayloadTooLargeError (413)
    ├── CapacityError (429, Retry-After)
    ├── NoRouteError (503)          no set of live nodes covers every layer
    ├── NodeStoppingError (503)     the node is stopping: the step or call will not run
    ├── RouteFailedError (502)      a route node died or stopped answering mid-session
    │   ├── HopError                a node could not be reached, timed out, or refused a request
    │   └── HopOpenError            the head could not open a hop after it (which one, and how)
    ├── BackendError (500)          the model backend failed
    │   ├── ModelLoadError           the model file is missing, not a GGUF, truncated, or llama.cpp refused it
    │   └── BackendCrashedError      the backend killed the process that ran its start-up decode
    ├── ArtifactError (500)         a model artifact is missing, truncated or fails its hashes
    │   └── FetchCancelled           a fetch was stopped (its resume data saved)
    └── PeerStatusError (any)       another server answered a status this tree has no class for
"""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationError


class SwarmrouteError(Exception):
    """Base class: ``status`` is the HTTP status, ``error_type`` the OpenAI ``error.type``, ``code`` a stable slug."""

    status: int = 500
    error_type: str = "server_error"
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 details: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.details = details
        if code is not None:
            self.code = code

    def http_headers(self) -> dict[str, str]:
        """Headers the response carries besides its body (``Retry-After`` for capacity errors)."""
        return {}

    def to_body(self) -> dict[str, object]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}`` (+ ``failure`` details)."""
        error: dict[str, object] = {"message": self.message, "type": self.error_type, "param": self.param,
                                    "code": self.code}
        if self.details:
            error.update(self.details)
        return {"error": error}


class BadRequestError(SwarmrouteError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthError(BadRequestError):
    code = "context_length_exceeded"


class FrameError(BadRequestError):
    code = "invalid_frame"


class StaleEpochError(BadRequestError):
    """A frame, route update or replay of an older epoch of the session's route than the receiver's: the sender
    was routed around by a repair (an evicted node is still alive and may still send)."""

    code = "stale_epoch"


class SnapshotError(BadRequestError):
    """A KV snapshot segment that fails its hash, or belongs to another model, layer range, session or position."""

    code = "invalid_snapshot"


class AuthenticationError(SwarmrouteError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class CapabilityError(AuthenticationError):
    code = "invalid_capability"


class PermissionDeniedError(SwarmrouteError):
    status = 403
    error_type = "permission_error"
    code = "permission_denied"


class NotFoundError(SwarmrouteError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"


class SessionNotFoundError(NotFoundError):
    code = "session_not_found"


class SessionEndedError(SessionNotFoundError):
    """The node no longer holds the session because it ended there (its head published, or is publishing, the
    end): a liveness probe's "ended", not "lost" (``actors.node.endings``)."""

    code = "session_ended"


class MethodNotAllowedError(SwarmrouteError):
    """The path exists, but not for this method; ``allow`` lists the methods it takes (the ``Allow`` header)."""

    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str = "", code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.allow = allow

    def http_headers(self) -> dict[str, str]:
        return {"allow": self.allow} if self.allow else {}


class PayloadTooLargeError(SwarmrouteError):
    status = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class CapacityError(SwarmrouteError):
    """The node or gateway is full; the client should retry after ``retry_after`` seconds."""

    status = 429
    error_type = "rate_limit_error"
    code = "capacity_exceeded"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after

    def http_headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, round(self.retry_after)))}


class NoRouteError(SwarmrouteError):
    status = 503
    error_type = "service_unavailable"
    code = "no_route"


class NodeStoppingError(SwarmrouteError, RuntimeError):
    """The node is stopping: the step or call will not run."""

    status = 503
    error_type = "service_unavailable"
    code = "node_stopping"


class RouteFailedError(SwarmrouteError):
    status = 502
    error_type = "route_failed"
    code = "route_failed"


HopErrorKind = Literal["unreachable", "timeout", "http_error"]


class HopError(RouteFailedError):
    """A node could not be reached (``unreachable``), timed out, or refused a request (``http_error``: the peer's
    status and its error, rebuilt, are kept)."""

    def __init__(self, node: str, kind: HopErrorKind, message: str, *, peer_status: int | None = None,
                 peer_error: SwarmrouteError | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.kind: HopErrorKind = kind
        self.peer_status = peer_status
        self.peer_error = peer_error


class HopOpenError(RouteFailedError):
    """The head could not open a hop after it (issue #20: the head opens the rest of its route). It carries what
    the gateway would have seen opening that hop itself, so that ``as_hop_error`` gives the gateway the same
    ``HopError``: the hop's node, how it failed, and its own status and error when it answered."""

    code = "hop_open_failed"

    def __init__(self, message: str, *, node: str, kind: HopErrorKind, peer_status: int | None = None,
                 peer_error: SwarmrouteError | None = None) -> None:
        hop: dict[str, object] = {"node": node, "kind": kind}
        if peer_status is not None:
            hop["status"] = peer_status
        if peer_error is not None:
            hop["error"] = peer_error.to_body()["error"]
        super().__init__(message, details={"hop": hop})
        self.node, self.kind = node, kind
        self.peer_status, self.peer_error = peer_status, peer_error

    @classmethod
    def of(cls, exc: HopError) -> HopOpenError:
        return cls(exc.message, node=exc.node, kind=exc.kind, peer_status=exc.peer_status, peer_error=exc.peer_error)

    @classmethod
    def from_error(cls, message: str, error: dict[str, object]) -> HopOpenError | None:
        """Rebuilt from the ``error`` object of a body; None if it does not say which hop failed, and how."""
        hop = error.get("hop")
        if not isinstance(hop, dict) or not isinstance(hop.get("node"), str) \
                or hop.get("kind") not in ("unreachable", "timeout", "http_error"):
            return None
        status = hop.get("status")
        peer_status = status if isinstance(status, int) else None
        peer_error = error_from_body(peer_status, {"error": hop["error"]}) \
            if peer_status is not None and isinstance(hop.get("error"), dict) else None
        return cls(message, node=hop["node"], kind=hop["kind"], peer_status=peer_status,
                   peer_error=peer_error)

    def as_hop_error(self) -> HopError:
        return HopError(self.node, self.kind, self.message, peer_status=self.peer_status, peer_error=self.peer_error)


class BackendError(SwarmrouteError):
    status = 500
    error_type = "server_error"
    code = "backend_error"


class ModelLoadError(BackendError):
    """The model file is missing, not a GGUF, truncated, or llama.cpp refused it. The message names the file."""

    code = "model_load_failed"


class BackendCrashedError(BackendError):
    """The backend killed (or failed) the child process that ran its start-up decode."""

    code = "backend_crashed"


class ArtifactError(SwarmrouteError):
    """A model artifact (manifest, GGUF, shard) is missing, truncated, or does not match its manifest's hashes."""

    status = 500
    error_type = "server_error"
    code = "artifact_error"


class FetchCancelled(ArtifactError):
    """A fetch was stopped on request; its resume data was saved first."""

    code = "fetch_cancelled"


class PeerStatusError(SwarmrouteError):
    """Another server answered with a status this tree has no class for: kept as it came."""

    def __init__(self, status: int, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status
        self.error_type = "invalid_request_error" if status < 500 else "server_error"


_BY_STATUS: dict[int, type[SwarmrouteError]] = {
    cls.status: cls for cls in (BadRequestError, AuthenticationError, PermissionDeniedError, NotFoundError,
                                MethodNotAllowedError, PayloadTooLargeError, CapacityError, NoRouteError,
                                RouteFailedError, BackendError)}
_BY_CODE: dict[tuple[int, str], type[SwarmrouteError]] = {
    (cls.status, cls.code): cls for cls in (ContextLengthError, FrameError, StaleEpochError, CapabilityError,
                                            ModelNotFoundError, SessionNotFoundError, NodeStoppingError, ModelLoadError,
                                            BackendCrashedError, ArtifactError, FetchCancelled)}
"""The classes a status alone does not name; ``HopError`` (it needs a node) and ``PeerStatusError`` are never
rebuilt from a peer's answer."""
REBUILT: tuple[type[SwarmrouteError], ...] = (*_BY_STATUS.values(), *_BY_CODE.values())
"""Every class a status and code rebuild: what each transport's round-trip test walks."""


def error_for_status(status: int, message: str, *, code: str | None = None) -> SwarmrouteError:
    """The error class of a status and code: the class of the tree with both (404 ``model_not_found`` is
    ``ModelNotFoundError``), else the status's (503 is ``NoRouteError``, 500 ``BackendError``), else a
    ``PeerStatusError``."""
    cls = _BY_CODE.get((status, code)) if code is not None else None
    cls = cls or _BY_STATUS.get(status)
    if cls is None:
        return PeerStatusError(status, message, code=code)
    return cls(message, code=code)


def error_from_body(status: int, body: object) -> SwarmrouteError:
    """Rebuild an error from an OpenAI-shaped body received from a peer (keeps status, message and code)."""
    message = f"HTTP {status}"
    code: str | None = None
    param: str | None = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        message = str(err.get("message") or message)
        code = str(err["code"]) if err.get("code") else None
        param = str(err["param"]) if err.get("param") else None
    if code == HopOpenError.code and isinstance(body, dict) and isinstance(body.get("error"), dict):
        relayed = HopOpenError.from_error(message, body["error"])
        if relayed is not None:
            return relayed
    error = error_for_status(status, message, code=code)
    error.param = param  # the field a relayed 400 names stays named
    return error


def validation_message(exc: ValidationError) -> str:
    """The first few problems of a pydantic validation error, on one line: ``field: problem; ...``."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {_problem(e['type'], e['msg'])}"
                     for e in exc.errors()[:5])


def _problem(kind: str, message: str) -> str:
    # OpenAI's words for an unknown field ("Unrecognized request argument supplied"), not pydantic's.
    return "unrecognized argument (no such field)" if kind == "extra_forbidden" else message


def validation_error(exc: ValidationError, *, what: str = "") -> BadRequestError:
    """A body that does not validate: a 400 naming the field (OpenAI's ``param``: its top-level name)."""
    param = next((str(e["loc"][0]) for e in exc.errors() if e["loc"]), None)
    return BadRequestError(f"{what}{validation_message(exc)}", param=param)
