"""Server-sent events exactly as the official openai client reads them: ``data:`` lines only, then ``[DONE]``.

No ``event:``, ``id:`` or ``retry:`` lines (they break the client); keep-alives are ``:`` comment lines.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def data(payload: BaseModel | dict[str, object]) -> bytes:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=False)
    else:
        text = json.dumps(payload, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"
