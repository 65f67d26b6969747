"""A node as the source of a prefix for other routes (issue #26): the KV it kept of a prompt's prefix, offered to a
hop of another route serving the same layers, which pulls it instead of computing it (``actors.node.prefix_pull``).

``POST /v1/prefixes`` (a ``PrefixOfferRequest``) matches the request's tokens against what this node kept
(``Reuse.share``: resident entries are exported for it, host pieces offered as kept) and answers a ``PrefixOffer``
naming its pieces as snapshot segments; ``GET /v1/prefixes/{offer}/{index}`` returns one piece with its metadata
(``bus.snapshot``: the puller checks its sha256). An offer lives until its last piece was read, or ``OFFER_TTL_S``;
at most ``MAX_OFFERS`` are held, the oldest going first. With capabilities on, an offer needs the tracker's grant
naming this node as the session's prefix source (``Hop.prefix_source``); the offer id, 128 random bits, then
stands for it.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from actors.node.admission import Admission
from actors.node.reuse import Reuse
from bus import snapshot as blobs
from bus.capability import HEADER_CAPABILITY
from bus.http_edge import read_model
from bus.nodeclient import SNAPSHOT_CONTENT_TYPE
from schemas.errors import BadRequestError, NotFoundError
from schemas.node import LayerRange
from schemas.prefix_offer import PrefixOffer, PrefixOfferRequest
from schemas.snapshot import SnapshotSegment, prefix_hash

OFFER_TTL_S = 60.0
MAX_OFFERS = 8


@dataclasses.dataclass
class _Offer:
    segments: list[SnapshotSegment]
    blobs: list[bytes]
    made: float = dataclasses.field(default_factory=time.monotonic)
    read: set[int] = dataclasses.field(default_factory=set)


class PrefixOffers:
    """The prefix endpoints of one node, over its ``Reuse``."""

    def __init__(self, reuse: Reuse, admission: Admission, *, model_id: str, layers: LayerRange, backend: str,
                 max_body_bytes: int) -> None:
        self._reuse = reuse
        self._admission = admission
        self._model_id = model_id
        self._layers = layers
        self._backend = backend
        self._max_body_bytes = max_body_bytes
        self._offers: collections.OrderedDict[str, _Offer] = collections.OrderedDict()
        self.offered = 0
        """Offers answered with something to pull."""
        self.pieces_served = 0

    def routes(self) -> list[HttpRoute]:
        return [HttpRoute("/v1/prefixes", self._offer, methods=["POST"]),
                HttpRoute("/v1/prefixes/{offer}/{index:int}", self._piece, methods=["GET"])]

    async def _offer(self, request: Request) -> Response:
        asked = await read_model(request, PrefixOfferRequest, self._max_body_bytes)
        if self._admission.enabled:
            self._admission.admit_standby(request.headers.get(HEADER_CAPABILITY), asked.session_id)
        return JSONResponse((await self.offer(asked)).model_dump(mode="json"))

    async def offer(self, asked: PrefixOfferRequest) -> PrefixOffer:
        if asked.model_id != self._model_id or asked.layers != self._layers:
            raise BadRequestError(f"this node serves layers {self._layers} of {self._model_id!r}, not "
                                  f"{asked.layers} of {asked.model_id!r}", param="layers")
        shared = await self._reuse.share(asked.tokens, asked.have)
        if shared is None:
            return PrefixOffer()
        name = secrets.token_hex(16)
        segments: list[SnapshotSegment] = []
        for index, ((start, end), blob, digest) in enumerate(zip(shared.bounds, shared.blobs, shared.digests,
                                                                  strict=True)):
            segments.append(SnapshotSegment(
                session_id=name, model_id=self._model_id, layers=self._layers, index=index, start=start, end=end,
                prefix_hash=prefix_hash(shared.tokens[:end]), parent=segments[-1].digest if segments else "",
                backend=self._backend, size=len(blob), digest=digest))
        self._forget_old()
        self._offers[name] = _Offer(segments, shared.blobs)
        self.offered += 1
        return PrefixOffer(offer=name, reusable=shared.reusable,
                           token_hash=prefix_hash(shared.tokens[:shared.reusable]), segments=segments)

    async def _piece(self, request: Request) -> Response:
        name, index = request.path_params["offer"], request.path_params["index"]
        offer = self._offers.get(name)
        if offer is None or not 0 <= index < len(offer.segments):
            raise NotFoundError(f"no prefix offer {name[:8]}... with a piece {index} here (expired, or read)",
                                code="prefix_offer_not_found")
        offer.read.add(index)
        if len(offer.read) == len(offer.segments):
            del self._offers[name]
        self.pieces_served += 1
        return Response(blobs.encode(offer.segments[index], offer.blobs[index]), media_type=SNAPSHOT_CONTENT_TYPE)

    def _forget_old(self) -> None:
        horizon = time.monotonic() - OFFER_TTL_S
        for name in [n for n, o in self._offers.items() if o.made < horizon]:
            del self._offers[name]
        while len(self._offers) >= MAX_OFFERS:
            self._offers.popitem(last=False)
