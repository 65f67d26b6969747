"""Errors that cross actor boundaries, each carrying its HTTP status and OpenAI error type.

One mapper (``gateway.errors``, and the node's own handler) turns them into OpenAI-shaped bodies::

    SwarmrouteError (500, server_error)
    ├── BadRequestError (400, invalid_request_error)
    │   ├── ContextLengthError       prompt + max_tokens exceed the context
    │   └── FrameError               activation frame with wrong size, dtype, position or session
    ├── AuthenticationError (401)
    │   └── CapabilityError          session capability missing, forged or expired (node API)
    ├── PermissionDeniedError (403)  a valid capability, but not for this node, hop, session or route
    ├── NotFoundError (404)
    │   ├── ModelNotFoundError
    │   └── SessionNotFoundError
    ├── PayloadTooLargeError (413)
    ├── CapacityError (429, Retry-After)
    ├── NoRouteError (503)          no set of live nodes covers every layer
    ├── RouteFailedError (502)      a route node died or stopped answering mid-session
    ├── BackendError (500)          the model backend failed
    └── ArtifactError (500)         a model artifact is missing, truncated or fails its hashes
"""

from __future__ import annotations


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


class NoRouteError(SwarmrouteError):
    status = 503
    error_type = "service_unavailable"
    code = "no_route"


class RouteFailedError(SwarmrouteError):
    status = 502
    error_type = "route_failed"
    code = "route_failed"


class BackendError(SwarmrouteError):
    status = 500
    error_type = "server_error"
    code = "backend_error"


class ArtifactError(SwarmrouteError):
    """A model artifact (manifest, GGUF, shard) is missing, truncated, or does not match its manifest's hashes."""

    status = 500
    error_type = "server_error"
    code = "artifact_error"


def error_from_body(status: int, body: object) -> SwarmrouteError:
    """Rebuild an error from an OpenAI-shaped body received from a peer (keeps status, message and code)."""
    message = f"HTTP {status}"
    code: str | None = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        message = str(err.get("message") or message)
        code = str(err["code"]) if err.get("code") else None
    for cls in (BadRequestError, AuthenticationError, PermissionDeniedError, NotFoundError, PayloadTooLargeError,
                CapacityError, NoRouteError, RouteFailedError):
        if cls.status == status:
            return cls(message, code=code)
    if 400 <= status < 500:
        error = BadRequestError(message, code=code)
        error.status = status
        return error
    return BackendError(message, code=code)
