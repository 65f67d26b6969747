"""A node as a standby holder of other nodes' snapshots (issue #18): its HTTP endpoints, and reading a lost hop's
chain back from its standby.

Holding: ``POST /v1/snapshots`` keeps a segment (a chain starts only with the tracker's grant naming this node,
when capabilities are on, and every later request must carry the session token that grant carried),
``GET /v1/snapshots/{id}?layers=A:B`` lists a chain, ``GET /v1/snapshots/{id}/{digest}`` returns a segment,
``DELETE /v1/snapshots/{id}`` forgets a session's chains.

Reading back:
A replacement trusts nothing it fetches: each segment's bytes must hash to its digest (``bus.snapshot.decode``),
be the one the head named (``Resume.segments``), belong to this session, model and layer range, and continue the
segment before it (index, parent digest, start position), and the chain must end where the head said. Any
mismatch is a ``SnapshotError`` naming it, before a byte reaches the backend.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from actors.node.admission import Admission
from actors.node.recovery.snapshot_store import SnapshotStore
from bus import snapshot as blobs
from bus.capability import HEADER_CAPABILITY, HEADER_SESSION_TOKEN
from bus.http_edge import read_body
from bus.nodeclient import SNAPSHOT_CONTENT_TYPE, NodeClient
from schemas.errors import BadRequestError, SessionNotFoundError, SnapshotError
from schemas.node import LayerRange
from schemas.session import Resume
from schemas.snapshot import SnapshotList


class StandbyApi:
    """The snapshot endpoints of one node, over its store."""

    def __init__(self, store: SnapshotStore, admission: Admission, node_id: str, *, max_body_bytes: int) -> None:
        self.store = store
        self._admission = admission
        self._node_id = node_id
        self._max_body_bytes = max_body_bytes
        self._tokens: dict[str, str] = {}
        """Session id -> the session token its first upload was granted with (admission on)."""

    def routes(self) -> list[HttpRoute]:
        return [HttpRoute("/v1/snapshots", self._put, methods=["POST"]),
                HttpRoute("/v1/snapshots/{sid}", self._list, methods=["GET"]),
                HttpRoute("/v1/snapshots/{sid}", self._drop, methods=["DELETE"]),
                HttpRoute("/v1/snapshots/{sid}/{digest}", self._get, methods=["GET"])]

    async def _put(self, request: Request) -> Response:
        body = await read_body(request.receive, dict(request.scope["headers"]), self._max_body_bytes)
        segment, kv = blobs.decode(body)
        self._check(segment.session_id, request, first=segment.index == 0)
        self.store.put(segment, kv)
        return JSONResponse({"digest": segment.digest, "end": segment.end}, status_code=201)

    async def _list(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        self._check(sid, request)
        try:
            layers = LayerRange.parse(request.query_params.get("layers", ""))
        except ValueError as exc:
            raise BadRequestError(str(exc), param="layers") from None
        return JSONResponse(SnapshotList(segments=self.store.chain(sid, layers)).model_dump(mode="json"))

    async def _get(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        self._check(sid, request)
        segment, kv = self.store.blob(request.path_params["digest"])
        if segment.session_id != sid:
            raise SessionNotFoundError(f"segment {segment.digest[:16]}... is not one of session {sid}'s")
        return Response(blobs.encode(segment, kv), media_type=SNAPSHOT_CONTENT_TYPE)

    async def _drop(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        self._check(sid, request)
        self._tokens.pop(sid, None)
        return JSONResponse({"dropped": self.store.drop(sid)})

    def _check(self, session_id: str, request: Request, *, first: bool = False) -> None:
        """With admission on, a chain is started only with the tracker's grant naming this node its standby, and
        every later request about it must carry the session token that grant carried."""
        if not self._admission.enabled:
            return
        if first:
            grant = self._admission.admit_standby(request.headers.get(HEADER_CAPABILITY), session_id)
            self._tokens[session_id] = grant.session_token
            return
        bound = self._tokens.get(session_id)
        if bound is None:
            raise SessionNotFoundError(f"node {self._node_id} holds no snapshots of session {session_id}")
        Admission.check_session_token(bound, request.headers.get(HEADER_SESSION_TOKEN))


async def fetch_chain(client: NodeClient, resume: Resume, session_id: str, layers: LayerRange, model_id: str, *,
                      session_token: str | None) -> list[bytes]:
    """The KV blobs of the segments ``resume`` names, in order, every one checked."""
    standby = resume.standby
    if standby is None:
        raise SnapshotError("the resume names snapshot segments but no standby holding them")
    kv: list[bytes] = []
    parent, end = "", 0
    for index, digest in enumerate(resume.segments):
        body = await client.get_snapshot(standby.node_id, standby.endpoint, session_id, digest,
                                         session_token=session_token)
        segment, blob = blobs.decode(body)
        problem = (f"is segment {segment.digest[:16]}..., not {digest[:16]}..." if segment.digest != digest
                   else f"is of session {segment.session_id}" if segment.session_id != session_id
                   else f"is of model {segment.model_id}" if segment.model_id != model_id
                   else f"holds layers {segment.layers}, not {layers}" if segment.layers != layers
                   else f"is segment {segment.index} with parent {segment.parent[:16]}... from position "
                        f"{segment.start}" if (segment.index, segment.parent, segment.start) != (index, parent, end)
                   else "")
        if problem:
            raise SnapshotError(f"snapshot segment {index} from {standby.node_id} {problem}")
        kv.append(blob)
        parent, end = segment.digest, segment.end
    if end != resume.start:
        raise SnapshotError(f"the snapshot chain from {standby.node_id} ends at position {end}, not {resume.start}")
    return kv
