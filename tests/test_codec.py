"""bus.codec: wire models survive msgpack exactly, newer peers' extra fields are kept, garbage is a DecodeError."""

from __future__ import annotations

import msgpack
import pytest

from bus import codec
from bus.codec import DecodeError
from schemas.node import BackendInfo, Capacity, LayerRange, NodeAdvertisement
from schemas.route import Hop, Route, RouteReply, RouteRequest
from schemas.session import FailureReason, HopTiming, SessionEnd, SessionPhase, TokenEvent
from schemas.telemetry import GenerationTelemetry, RouteHopView


def advert() -> NodeAdvertisement:
    return NodeAdvertisement(
        node_id="n1", endpoint="http://127.0.0.1:9101", model_id="m", layers=LayerRange(start=0, end=4),
        is_head=True, is_tail=False,
        backend=BackendInfo(kind="stub", n_layers=8, hidden_size=64, hidden_shape=[4, 16], context_length=4096),
        capacity=Capacity(max_sessions=4, active_sessions=1, max_context=4096))


def route() -> Route:
    return Route(session_id="s1", model_id="m", n_layers=8, hidden_shape=[64], context_length=4096,
                 hops=[Hop(node_id="n1", endpoint="http://a", layers=LayerRange(start=0, end=4)),
                       Hop(node_id="n2", endpoint="http://b", layers=LayerRange(start=4, end=8))])


SAMPLES = [
    advert(),
    RouteRequest(model="m", session_id="s1", exclude=["n3"]),
    RouteReply(route=route()),
    RouteReply(error="no route", status=503, uncovered=[LayerRange(start=12, end=18)]),
    TokenEvent(session_id="s1", seq=3, token=65, text="é✓", finish_reason="length",
               hop_timings=[HopTiming(node_id="n1", compute_ms=0.25, queue_ms=0.01)]),
    SessionEnd(session_id="s1", phase=SessionPhase.FAILED,
               failure=FailureReason(node_id="n2", phase=SessionPhase.DECODE, kind="timeout", message="gone")),
    GenerationTelemetry(session_id="s1", seq=7, phase=SessionPhase.DECODE, hop_overhead_ms=0.3,
                        route=[RouteHopView(node_id="n1", layers=LayerRange(start=0, end=8))]),
]


@pytest.mark.parametrize("model", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_is_equal(model: object) -> None:
    data = codec.encode(model)  # type: ignore[arg-type]
    assert isinstance(data, bytes)
    back = codec.decode(data, type(model))  # type: ignore[arg-type]
    assert back == model
    assert codec.encode(back) == data


def test_payload_is_a_plain_msgpack_map_any_language_can_read() -> None:
    raw = msgpack.unpackb(codec.encode(SAMPLES[4]), raw=False)
    assert raw["session_id"] == "s1" and raw["text"] == "é✓" and raw["schema_version"] == 1
    assert raw["hop_timings"][0]["compute_ms"] == 0.25


def test_unknown_fields_from_a_newer_peer_are_tolerated_and_kept() -> None:
    raw = msgpack.unpackb(codec.encode(advert()), raw=False)
    raw["future_field"] = {"nested": [1, 2]}
    raw["capacity"]["gpu_count"] = 2
    got = codec.decode(msgpack.packb(raw, use_bin_type=True), NodeAdvertisement)
    assert got.node_id == "n1"
    assert got.model_extra == {"future_field": {"nested": [1, 2]}}
    assert got.capacity.model_extra == {"gpu_count": 2}
    # Relaying it keeps what this version does not understand.
    assert msgpack.unpackb(codec.encode(got), raw=False)["future_field"] == {"nested": [1, 2]}


@pytest.mark.parametrize("data, fragment", [
    (b"", "not a msgpack RouteRequest"),
    (b"\xc1", "not a msgpack RouteRequest"),                  # reserved, never valid
    (b"\x92\x01", "not a msgpack RouteRequest"),              # truncated array
    (b"\x81\x01\x02", "not a msgpack RouteRequest"),          # integer map key
    (b"\xa2\xff\xfe", "not a msgpack RouteRequest"),          # string that is not UTF-8
    (b"\x01\x02", "not a msgpack RouteRequest"),              # trailing bytes
    (msgpack.packb([1, 2]), "RouteRequest must be a msgpack map, got list"),
    (msgpack.packb("text"), "RouteRequest must be a msgpack map, got str"),
    (msgpack.packb({"model": "m"}), "session_id"),            # missing field is named
    (msgpack.packb({"model": "", "session_id": "s"}), "model"),
    (msgpack.packb({"model": "m", "session_id": "s", "exclude": "n1"}), "exclude"),
])
def test_bad_bytes_raise_decode_error_naming_the_problem(data: bytes, fragment: str) -> None:
    with pytest.raises(DecodeError) as info:
        codec.decode(data, RouteRequest)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_nested_validation_is_enforced() -> None:
    raw = msgpack.unpackb(codec.encode(advert()), raw=False)
    raw["layers"] = {"start": 5, "end": 5}
    with pytest.raises(DecodeError, match="must be greater than start"):
        codec.decode(msgpack.packb(raw), NodeAdvertisement)
