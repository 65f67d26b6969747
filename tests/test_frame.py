"""bus.frame: the binary activation frame round-trips exactly and rejects every malformed input precisely."""

from __future__ import annotations

import dataclasses
import struct
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus import frame as frames
from bus.frame import FrameDecodeError
from schemas.frame import MAGIC, MAX_DIMS, FrameHeader, FrameKind, HopStamp, SampledToken, WireDType
from schemas.session import MAX_TOP_LOGPROBS, LogprobCandidate, TokenLogprobs

SID = uuid.UUID("0123456789abcdef0123456789abcdef").bytes
FIXED = 40  # documented size of the fixed header


def header(shape: tuple[int, ...] = (8,), n: int = 3, dtype: WireDType = WireDType.F32,
           stamps: tuple[HopStamp, ...] = (), **kw: object) -> FrameHeader:
    return FrameHeader(session_id=SID, kind=kw.pop("kind", FrameKind.DECODE), dtype=dtype,  # type: ignore[arg-type]
                       start_position=kw.pop("start", 17), n_positions=n, position_shape=shape,  # type: ignore[arg-type]
                       step=kw.pop("step", 5), sample=kw.pop("sample", True), stamps=stamps)  # type: ignore[arg-type]


def hidden_for(h: FrameHeader, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((h.n_positions, *h.position_shape)).astype(np.float32)


def test_fixed_header_size_matches_documented_layout() -> None:
    assert frames.header_size(0, 0) == FIXED
    assert frames.header_size(2, 3) == FIXED + 2 * 4 + 3 * 12


def test_f32_round_trip_is_bit_exact_with_stamps() -> None:
    stamps = (HopStamp(0, 1234, 5), HopStamp(1, 99, 0), HopStamp(2, 2**32 - 1, 7))
    h = header(shape=(16,), n=4, stamps=stamps)
    x = hidden_for(h)
    data = frames.encode(h, x)
    assert len(data) == frames.header_size(1, 3) + h.payload_bytes
    got_h, got_x = frames.decode(data)
    assert got_h == h
    assert got_x.dtype == np.float32 and got_x.shape == (4, 16)
    assert np.array_equal(got_x, x)


def test_f16_round_trip_halves_payload_and_rounds_like_numpy() -> None:
    h16, h32 = header(dtype=WireDType.F16), header(dtype=WireDType.F32)
    x = hidden_for(h16)
    d16, d32 = frames.encode(h16, x), frames.encode(h32, x)
    assert len(d16) - frames.header_size(1, 0) == (len(d32) - frames.header_size(1, 0)) // 2
    got_h, got_x = frames.decode(d16)
    assert got_h.dtype is WireDType.F16
    assert got_x.dtype == np.float32
    assert np.array_equal(got_x, x.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("shape", [(4, 32), (2, 3, 5), (1, 2, 3, 4)])
def test_multi_dim_position_shapes_round_trip(shape: tuple[int, ...]) -> None:
    h = header(shape=shape, n=2)
    x = hidden_for(h, seed=len(shape))
    got_h, got_x = frames.decode(frames.encode(h, x))
    assert got_h.position_shape == shape
    assert got_x.shape == (2, *shape)
    assert np.array_equal(got_x, x)


def test_prefill_frame_without_sample_flag() -> None:
    h = header(kind=FrameKind.PREFILL, sample=False, step=0, start=0, n=7)
    got_h, _ = frames.decode(frames.encode(h, hidden_for(h)))
    assert got_h.kind is FrameKind.PREFILL and got_h.sample is False and got_h.step == 0


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=MAX_DIMS).map(tuple),
    n=st.integers(1, 5),
    dtype=st.sampled_from(list(WireDType)),
    kind=st.sampled_from(list(FrameKind)),
    sid=st.binary(min_size=16, max_size=16),
    step=st.integers(0, 2**32 - 1),
    start=st.integers(0, 2**32 - 1),
    sample=st.booleans(),
    stamps=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
                    max_size=5),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(shape: tuple[int, ...], n: int, dtype: WireDType, kind: FrameKind, sid: bytes, step: int,
                             start: int, sample: bool, stamps: list[tuple[int, int, int]], seed: int) -> None:
    h = FrameHeader(session_id=sid, kind=kind, dtype=dtype, start_position=start, n_positions=n, position_shape=shape,
                    step=step, sample=sample, stamps=tuple(HopStamp(*s) for s in stamps))
    x = hidden_for(h, seed)
    data = frames.encode(h, x)
    assert len(data) == frames.header_size(len(shape), len(stamps)) + h.payload_bytes
    got_h, got_x = frames.decode(data)
    assert got_h == h
    if dtype is WireDType.BF16:
        # Independent reference: keep 8 significant bits, ties to even (np.round), via frexp/ldexp.
        mantissa, exponent = np.frexp(x.astype(np.float64))
        expected = np.ldexp(np.round(mantissa * 256), exponent - 8).astype(np.float32)
    else:
        wire = np.float16 if dtype is WireDType.F16 else np.float32
        expected = x.astype(wire).astype(np.float32)
    assert np.array_equal(got_x, expected)


def test_session_id_helpers_round_trip_and_reject_non_uuid() -> None:
    sid = uuid.uuid4().hex
    assert frames.session_str(frames.session_bytes(sid)) == sid
    with pytest.raises(ValueError, match="not a 32-digit hex uuid"):
        frames.session_bytes("not-a-uuid")


# ---- malformed input ---------------------------------------------------------------------------------------------

def valid_frame(shape: tuple[int, ...] = (8,), n: int = 3, stamps: int = 1) -> bytes:
    h = header(shape=shape, n=n, stamps=tuple(HopStamp(i, 10, 1) for i in range(stamps)))
    return frames.encode(h, hidden_for(h))


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


def test_bad_magic() -> None:
    data = b"XXXX" + valid_frame()[4:]
    with pytest.raises(FrameDecodeError, match=r"bad magic b'XXXX', expected b'SRF1'"):
        frames.decode(data)


@pytest.mark.parametrize("length", [0, 3, 4, FIXED - 1])
def test_shorter_than_fixed_header(length: int) -> None:
    with pytest.raises(FrameDecodeError, match=rf"frame is {length} bytes, shorter than the {FIXED}-byte fixed header"):
        frames.decode(valid_frame()[:length])


def test_truncated_dims_and_stamps() -> None:
    data = valid_frame(shape=(4, 32), stamps=2)
    need = frames.header_size(2, 2)
    for cut in (FIXED, FIXED + 4, need - 1):
        with pytest.raises(FrameDecodeError, match=rf"frame is {cut} bytes, header alone needs {need}"):
            frames.decode(data[:cut])


def test_payload_too_short_and_too_long() -> None:
    data = valid_frame(shape=(8,), n=3)
    need = 3 * 8 * 4
    with pytest.raises(FrameDecodeError,
                       match=rf"payload is {need - 1} bytes; 3 positions of \(8,\) f32 need {need}"):
        frames.decode(data[:-1])
    with pytest.raises(FrameDecodeError,
                       match=rf"payload is {need + 4} bytes; 3 positions of \(8,\) f32 need {need}"):
        frames.decode(data + b"\0" * 4)


def test_zero_dimension_rejected() -> None:
    data = patched(valid_frame(shape=(4, 32)), FIXED + 4, "<I", 0)
    with pytest.raises(FrameDecodeError, match=r"position shape \(4, 0\) has a zero dimension"):
        frames.decode(data)


@pytest.mark.parametrize("n_dims", [0, MAX_DIMS + 1, 255])
def test_n_dims_out_of_range(n_dims: int) -> None:
    data = patched(valid_frame(), 7, "<B", n_dims)
    with pytest.raises(FrameDecodeError, match=rf"n_dims {n_dims} outside 1\.\.{MAX_DIMS}"):
        frames.decode(data)


def test_unknown_dtype_named_precisely() -> None:
    data = patched(valid_frame(), 5, "<B", 7)
    with pytest.raises(FrameDecodeError, match=r"^unknown dtype 7 \(expected 0 f32, 1 f16 or 2 bf16\)$"):
        frames.decode(data)


def test_unknown_kind_named_precisely() -> None:
    data = patched(valid_frame(), 4, "<B", 9)
    with pytest.raises(FrameDecodeError, match=r"^unknown frame kind 9 \(expected 0 prefill or 1 decode\)$"):
        frames.decode(data)


def test_zero_positions_rejected() -> None:
    data = patched(valid_frame(), 32, "<I", 0)
    with pytest.raises(FrameDecodeError, match="frame carries no positions"):
        frames.decode(data)


def test_magic_constant_is_documented_value() -> None:
    assert MAGIC == b"SRF1"


# ---- encode-side validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad_shape", [(3, 9), (2, 8), (3, 8, 1), (24,)])
def test_encode_rejects_hidden_whose_shape_disagrees(bad_shape: tuple[int, ...]) -> None:
    h = header(shape=(8,), n=3)
    with pytest.raises(ValueError, match=r"hidden states have shape .* header says \(3, 8\)"):
        frames.encode(h, np.zeros(bad_shape, dtype=np.float32))


def test_encode_rejects_too_many_dims_and_stamps() -> None:
    h = header(shape=(1, 1, 1, 1, 2), n=1)
    with pytest.raises(ValueError, match=r"position shape must have 1\.\.4 dims"):
        frames.encode(h, np.zeros((1, 1, 1, 1, 1, 2), dtype=np.float32))
    h = header(stamps=tuple(HopStamp(i, 0, 0) for i in range(frames.MAX_STAMPS + 1)))
    with pytest.raises(ValueError, match="at most 64 hop stamps"):
        frames.encode(h, hidden_for(h))


def test_bf16_keeps_the_f32_range_and_rounds_to_nearest_even() -> None:
    import numpy as np

    from bus import frame as fr
    from schemas.frame import FrameHeader, FrameKind, WireDType

    hidden = np.array([[1.0, -2.5, 3e5, 1e-3, 1.00390625 + 2**-9]], dtype=np.float32)
    header = FrameHeader(session_id=bytes(16), kind=FrameKind.DECODE, dtype=WireDType.BF16, start_position=0,
                         n_positions=1, position_shape=(5,))
    data = fr.encode(header, hidden)
    assert len(data) == fr.header_size(1, 0) + 5 * 2
    _, back = fr.decode(data)
    # bf16 keeps 8 mantissa bits: relative error below 2**-8, and values far past f16's 65504 stay finite.
    assert np.all(np.isfinite(back))
    assert np.all(np.abs(back - hidden) <= np.abs(hidden) * 2**-8)
    assert back[0, 0] == 1.0 and back[0, 1] == -2.5


def test_f16_refuses_values_beyond_its_range_instead_of_sending_infinity() -> None:
    import numpy as np
    import pytest

    from bus import frame as fr
    from schemas.frame import FrameHeader, FrameKind, WireDType

    header = FrameHeader(session_id=bytes(16), kind=FrameKind.DECODE, dtype=WireDType.F16, start_position=0,
                         n_positions=1, position_shape=(2,))
    with pytest.raises(ValueError, match="f16 range"):
        fr.encode(header, np.array([[1.0, 1e5]], dtype=np.float32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [WireDType.F32, WireDType.BF16])
def test_non_finite_activations_are_refused_at_decode(bad: float, dtype: WireDType) -> None:
    h = header(dtype=dtype)
    values = hidden_for(h)
    values[1, 3] = bad  # encode does not look: a buggy or hostile sender could send this
    data = frames.encode(h, values) if dtype is WireDType.F32 else _encode_bf16_unchecked(h, values)
    with pytest.raises(FrameDecodeError, match="non-finite"):
        frames.decode(data)
    frames.decode(frames.encode(h, hidden_for(h)))  # finite values still pass


def _encode_bf16_unchecked(h: FrameHeader, values: np.ndarray) -> bytes:
    good = frames.encode(h, np.zeros_like(values))
    payload = (values.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    return good[:len(good) - len(payload)] + payload


# ---- token frames ----------------------------------------------------------------------------------------------

def sampled(**overrides: object) -> SampledToken:
    fields: dict[str, object] = dict(session_id=bytes(range(16)), seq=41, token=262143, text="naïve 🙂",
                                     finish_reason="length", stamps=(HopStamp(0, 5000, 12), HopStamp(1, 15000, 0)))
    fields.update(overrides)
    return SampledToken(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("token", [sampled(), sampled(text="", finish_reason=None, stamps=()),
                                   sampled(finish_reason="stop", seq=0)])
def test_token_frames_round_trip(token: SampledToken) -> None:
    assert frames.decode_token(frames.encode_token(token)) == token


def test_token_frame_layout_is_fixed() -> None:
    data = frames.encode_token(sampled(text="ab", stamps=(HopStamp(2, 3, 4),)))
    assert data[:4] == b"SRT1" and data[4] == 2 and data[5] == 1 and len(data) == 36 + 12 + 2
    assert struct.unpack_from("<III", data, 24) == (41, 262143, 2)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d[:20], r"shorter than the 36-byte header"),
    (lambda d: b"SRF1" + d[4:], r"bad magic"),
    (lambda d: d[:4] + bytes([7]) + d[5:], r"unknown finish code 7"),
    (lambda d: d + b"x", r"need"),
    (lambda d: d[:-1], r"need"),
    (lambda d: d[:-2] + b"\xff\xfe", r"not UTF-8"),
])
def test_bad_token_frames_are_named(mutate, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FrameDecodeError, match=message):
        frames.decode_token(mutate(frames.encode_token(sampled(text="ok"))))


# ---- token frames: choices and logprobs (issue #19) --------------------------------------------------------------

def top5_logprobs(token: int = 262143) -> TokenLogprobs:
    # f32-exact values: the frame carries f32, and these survive the round trip bit for bit.
    top = [LogprobCandidate(token=t, logprob=lp) for t, lp in
           [(token, -0.25), (17, -1.5), (262000, -2.75), (0, -3.0), (99, -10.5)]]
    return TokenLogprobs(token=token, logprob=-0.25, top=top)


@pytest.mark.parametrize("token", [
    sampled(logprobs=top5_logprobs()),
    sampled(logprobs=TokenLogprobs(token=262143, logprob=-0.125)),  # the sampled token's logprob only
    sampled(choice=7, seq=0, text="", logprobs=top5_logprobs()),
    sampled(choice=255),
    sampled(logprobs=TokenLogprobs(token=262143, logprob=-0.5, top=[
        LogprobCandidate(token=i, logprob=-float(i)) for i in range(MAX_TOP_LOGPROBS)])),
], ids=["top5", "token-only", "choice-7", "choice-255", "top20"])
def test_token_frames_with_choices_and_logprobs_round_trip(token: SampledToken) -> None:
    back = frames.decode_token(frames.encode_token(token))
    assert back == token
    assert back.logprobs == token.logprobs and back.choice == token.choice


def test_a_token_frame_without_logprobs_is_the_pre_issue_19_frame() -> None:
    # Not asking for logprobs costs nothing: flags and choice sit in what were reserved zero bytes, and no section
    # follows the text, so the frame is byte for byte what an old tail sent (and an old head can parse it).
    token = sampled(text="ab", stamps=(HopStamp(2, 3, 4),))
    data = frames.encode_token(token)
    old = struct.pack("<4sBB2x16sIII", b"SRT1", 2, 1, bytes(range(16)), 41, 262143, 2) + struct.pack(
        "<III", 2, 3, 4) + b"ab"
    assert data == old
    assert frames.decode_token(old) == token


def test_logprobs_cost_five_bytes_plus_eight_per_alternative() -> None:
    plain = frames.encode_token(sampled())
    only = frames.encode_token(sampled(logprobs=TokenLogprobs(token=262143, logprob=-0.125)))
    top5 = frames.encode_token(sampled(logprobs=top5_logprobs()))
    assert len(only) - len(plain) == 5
    assert len(top5) - len(plain) == 5 + 8 * 5
    assert top5[6] == 1 and plain[6] == 0  # the flag


def test_encode_token_refuses_what_the_frame_cannot_carry() -> None:
    with pytest.raises(ValueError, match="choice 256"):
        frames.encode_token(sampled(choice=256))
    too_many = [LogprobCandidate.model_construct(token=i, logprob=-1.0) for i in range(MAX_TOP_LOGPROBS + 1)]
    with pytest.raises(ValueError, match="at most 20"):
        frames.encode_token(sampled(logprobs=TokenLogprobs.model_construct(token=1, logprob=-1.0, top=too_many)))


def _with_logprob_bytes(section: bytes) -> bytes:
    data = bytearray(frames.encode_token(sampled(text="ok")))
    data[6] = 1
    return bytes(data) + section


@pytest.mark.parametrize(("data", "message"), [
    (lambda: _with_logprob_bytes(b""), r"flagged logprobs section missing"),
    (lambda: _with_logprob_bytes(struct.pack("<fB", -1.0, 21)), r"lists 21 alternatives, more than 20"),
    (lambda: _with_logprob_bytes(struct.pack("<fB", -1.0, 2) + struct.pack("<If", 5, -2.0)), r"top logprobs need"),
    (lambda: _with_logprob_bytes(struct.pack("<fB", -1.0, 1) + struct.pack("<If", 5, -2.0) + b"x"), r"need"),
    (lambda: _with_logprob_bytes(struct.pack("<fB", float("nan"), 0)), r"finite and <= 0"),
    (lambda: _with_logprob_bytes(struct.pack("<fB", -1.0, 1) + struct.pack("<If", 5, 0.5)), r"finite and <= 0"),
    (lambda: frames.encode_token(sampled(text="ok"))[:6] + b"\x02" + frames.encode_token(sampled(text="ok"))[7:],
     r"unknown token frame flags 0x02"),
], ids=["missing", "too-many", "short-top", "trailing", "nan", "positive", "unknown-flag"])
def test_bad_logprobs_sections_are_named(data, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FrameDecodeError, match=message):
        frames.decode_token(data())


def test_bytes_per_token_with_top5_logprobs(capsys: pytest.CaptureFixture[str]) -> None:
    """The number in docs/protocol.md: a typical 2-hop decode token frame, without and with top-5 logprobs."""
    stamps = (HopStamp(0, 16000, 20), HopStamp(1, 17000, 30))
    plain = len(frames.encode_token(sampled(text=" the", stamps=stamps)))
    top5 = len(frames.encode_token(sampled(text=" the", stamps=stamps, logprobs=top5_logprobs())))
    with capsys.disabled():
        print(f"\ntoken frame, 2 hops, 4 text bytes: {plain} B plain, {top5} B with top-5 logprobs (+{top5 - plain})")
    assert (plain, top5) == (36 + 24 + 4, 36 + 24 + 4 + 45)


def test_activation_frames_carry_their_choice_in_a_reserved_byte() -> None:
    h = header(stamps=(HopStamp(0, 1, 2),))
    plain = frames.encode(h, hidden_for(h))
    assert plain[37:40] == bytes(3)  # unused, the frame is the pre-issue-19 frame
    chosen = dataclasses.replace(h, choice=200)
    data = frames.encode(chosen, hidden_for(h))
    assert data[37] == 200 and data[:37] == plain[:37] and data[38:] == plain[38:]
    back, _ = frames.decode(data)
    assert back == chosen
    with pytest.raises(ValueError, match="choice 256"):
        frames.encode(dataclasses.replace(h, choice=256), hidden_for(h))


def test_a_round_frame_names_its_group_in_byte_38() -> None:
    h = header(stamps=(HopStamp(0, 1, 2),))
    plain = frames.encode(h, hidden_for(h))
    grouped = dataclasses.replace(h, choice=2, group=3)
    data = frames.encode(grouped, hidden_for(h))
    assert data[37] == 2 and data[38] == 3 and data[39] == 0 and data[39:] == plain[39:]
    back, _ = frames.decode(data)
    assert back == grouped and back.group == 3
    with pytest.raises(ValueError, match="group 256"):
        frames.encode(dataclasses.replace(h, group=256), hidden_for(h))
