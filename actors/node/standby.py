"""Reading a lost hop's snapshot chain back from its standby holder (issue #18).

A replacement trusts nothing it fetches: each segment's bytes must hash to its digest (``bus.snapshot.decode``),
be the one the head named (``Resume.segments``), belong to this session, model and layer range, and continue the
segment before it (index, parent digest, start position), and the chain must end where the head said. Any
mismatch is a ``SnapshotError`` naming it, before a byte reaches the backend.
"""

from __future__ import annotations

from bus import snapshot as blobs
from bus.nodeclient import NodeClient
from schemas.errors import SnapshotError
from schemas.node import LayerRange
from schemas.session import Resume


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
