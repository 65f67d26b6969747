"""The torch backend's KV in and out (issue #18, ``actors.backend.KvBackend``): export/import, truncate, prefix
copies and sampler replay on tiny seeded models chained in-process through real activation frames.

torch computes exactly: every continuation is held to the uninterrupted run's logits bit for bit (``torch.equal``),
never to a tolerance. Runs being compared take the same step shapes (same prefill chunks, one-position decode
steps), since chunked and whole-sequence matmuls round differently.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct

import numpy as np
import pytest
import torch

from actors.backend import KvBackend, StepInput
from actors.backends.torch.backend import TorchBackend
from schemas.errors import BadRequestError, SessionNotFoundError, SnapshotError
from schemas.session import Prompt, SamplingParams
from tests.support.torch_route import GREEDY, LONG_PROMPT, WireRoute, build_route

SHORT_PROMPT = "Hi there"
WINDOW = 16
"""tiny-gemma3's sliding window (``models.tiny_gemma3_config``); its layers are sliding, sliding, full, x2."""
HEAD = struct.Struct("<4s8sBIIIQQ")
"""The blob header as ``actors.backends.torch.kv`` documents it: magic, model tag, dtype code, layer start, layer
end, the model's layer count, start, end; then one ``LAYER`` record per layer."""
LAYER = struct.Struct("<IIQQIII")


@dataclasses.dataclass
class Trace:
    tokens: list[int] = dataclasses.field(default_factory=list)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def add(self, route: WireRoute, sid: str, token: int | None) -> int:
        assert token is not None
        self.tokens.append(token)
        self.logits.append(tail(route).last_logits(sid))
        return token


def tail(route: WireRoute) -> TorchBackend:
    return route.backends[-1]


def ids_of(route: WireRoute, text: str) -> list[int]:
    return route.backends[0].tokenize(Prompt(text=text))


def feed(route: WireRoute, sid: str, tokens: list[int], start: int, trace: Trace, chunk: int = 7) -> int:
    """Step ``tokens`` (positions ``start``...) in chunks, sampling after the last one."""
    token = None
    for a in range(0, len(tokens), chunk):
        token = route.step([(sid, start + a, tokens[a:a + chunk], a + chunk >= len(tokens))])[0]
    return trace.add(route, sid, token)


def decode(route: WireRoute, sid: str, position: int, token: int, n: int, trace: Trace) -> int:
    """``n`` one-position steps from ``position``, feeding ``token`` first and then each sampled one."""
    for i in range(n):
        token = trace.add(route, sid, route.step([(sid, position + i, [token], True)])[0])
    return token


def assert_same(got: Trace, expected: Trace) -> None:
    diffs = [float((a - b).abs().max()) for a, b in zip(got.logits, expected.logits, strict=True)]
    assert diffs == [0.0] * len(expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits, strict=True))
    assert got.tokens == expected.tokens


def test_every_torch_shard_is_a_kv_backend() -> None:
    for backend in build_route("tiny-gemma3", (0, 2, 4, 6)):
        assert isinstance(backend, KvBackend)


# ---- export + import -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "bounds", "text", "late"), [
    ("tiny-llama", (0, 3, 6), LONG_PROMPT, False),
    ("tiny-llama", (0, 2, 4, 6), LONG_PROMPT, True),
    ("tiny-gemma3", (0, 3, 6), LONG_PROMPT, False),
    ("tiny-gemma3", (0, 2, 4, 6), LONG_PROMPT, True),
    ("tiny-gemma3", (0, 3, 6), SHORT_PROMPT, False),
], ids=["llama-2node", "llama-3node-late", "gemma-2node", "gemma-3node-late", "gemma-below-window"])
def test_export_import_on_fresh_backends_continues_bit_exactly(model: str, bounds: tuple[int, ...], text: str,
                                                               late: bool) -> None:
    """A chain of segments, exported as snapshots are (at the end of prefill, then 5 decoded positions later) or
    all at the end (``late``: windowed layers have let the early segments' positions go), imported on fresh
    backends of the same split: the continuation is the uninterrupted run's, bit for bit, on every hop."""
    source, rebuilt = WireRoute(build_route(model, bounds)), WireRoute(build_route(model, bounds))
    ids = ids_of(source, text)
    n_prompt = len(ids)
    if text == LONG_PROMPT:
        assert n_prompt > 4 * WINDOW
    else:
        assert n_prompt + 5 < WINDOW  # imported below the window; the continuation then crosses it
    sid = source.open(ids)
    so_far = Trace()
    token = feed(source, sid, ids, 0, so_far)
    cuts = [0, 10, n_prompt, n_prompt + 5] if late else [0, n_prompt, n_prompt + 5]
    blobs: list[list[bytes]] = [[] for _ in source.backends]
    if not late:
        for hop, backend in enumerate(source.backends):
            blobs[hop].append(backend.export_kv(sid, 0, n_prompt))
    token = decode(source, sid, n_prompt, token, 5, so_far)
    at = n_prompt + 5
    for hop, backend in enumerate(source.backends):
        blobs[hop] += [backend.export_kv(sid, a, b) for a, b in itertools.pairwise(cuts)
                       if late or a >= n_prompt]

    copy = rebuilt.open(ids)
    for backend, chain in zip(reversed(rebuilt.backends), reversed(blobs), strict=True):  # tail first, as opened
        backend.import_kv(copy, chain, at)
    tail(rebuilt).replay_sampled(copy, so_far.tokens)
    assert [b.kv_bytes_in_use() for b in rebuilt.backends] == [b.kv_bytes_in_use() for b in source.backends]

    expected, got = Trace(), Trace()
    decode(source, sid, at, token, 24, expected)  # 24: gemma's windowed layers turn over in between
    decode(rebuilt, copy, at, token, 24, got)
    assert_same(got, expected)
    for hop in range(len(bounds) - 2):  # every hop's frames of the continuation are the same bytes too
        sent, resent = source.hop_outputs[sid][hop][-24:], rebuilt.hop_outputs[copy][hop]
        assert all(np.array_equal(a, b) for a, b in zip(sent, resent, strict=True))


def test_foreign_corrupted_and_non_continuing_blobs_are_refused_and_change_nothing() -> None:
    source, fresh = WireRoute(build_route("tiny-gemma3", (0, 3, 6))), WireRoute(build_route("tiny-gemma3", (0, 3, 6)))
    ids = ids_of(source, LONG_PROMPT)
    n_prompt = len(ids)
    sid = source.open(ids)
    token = feed(source, sid, ids, 0, Trace())
    head_blob, blob = (b.export_kv(sid, 0, n_prompt) for b in source.backends)
    copy = fresh.open(ids)
    target = tail(fresh)  # layers [3, 6): sliding, sliding, full

    def patched(data: bytes, **fields: int) -> bytes:
        values = dict(zip(["magic", "tag", "dtype", "first", "last", "n_layers", "start", "end"],
                          HEAD.unpack_from(data), strict=True))
        return HEAD.pack(*{**values, **fields}.values()) + data[HEAD.size:]

    def layer_patched(data: bytes, record: int, **fields: int) -> bytes:
        at = HEAD.size + record * LAYER.size
        values = dict(zip(["index", "window", "first", "rows", "heads", "k_dim", "v_dim"],
                          LAYER.unpack_from(data, at), strict=True))
        return data[:at] + LAYER.pack(*{**values, **fields}.values()) + data[at + LAYER.size:]

    assert patched(blob) == blob and layer_patched(blob, 2) == blob  # the test's reading of the format is right
    refused: dict[str, tuple[list[bytes], int]] = {
        "another layer range": ([head_blob], n_prompt),
        # tiny-llama's [3, 6) has the same layer count, KV heads and head dim: only the model tag tells them apart.
        "another model, same dims": ([tail_export("tiny-llama", n_prompt)], n_prompt),
        "another seed of the model": ([tail_export("tiny-gemma3", n_prompt, seed=1)], n_prompt),
        "a bf16 cache": ([tail_export("tiny-gemma3", n_prompt, dtype="bfloat16")], n_prompt),
        "magic": ([b"XKV1" + blob[4:]], n_prompt),
        "header layer range": ([patched(blob, first=2)], n_prompt),
        "header layer count": ([patched(blob, n_layers=7)], n_prompt),
        "header positions": ([patched(blob, end=n_prompt + 1)], n_prompt + 1),
        "layer window": ([layer_patched(blob, 0, window=2 * WINDOW)], n_prompt),
        "layer shape": ([layer_patched(blob, 2, heads=1)], n_prompt),
        "layer rows": ([layer_patched(blob, 2, rows=n_prompt - 1)], n_prompt),
        "cut short": ([blob[:-1]], n_prompt),
        "extended": ([blob + b"\0"], n_prompt),
        "only a header": ([blob[:HEAD.size]], n_prompt),
        "empty": ([b""], n_prompt),
        "ends elsewhere": ([blob], n_prompt + 1),
        "does not start at the session's position": ([source.backends[1].export_kv(sid, 10, n_prompt)], n_prompt),
        "a gap between blobs": ([source.backends[1].export_kv(sid, 0, 10),
                                 source.backends[1].export_kv(sid, 20, n_prompt)], n_prompt),
        # Exported late, [0, 10) holds none of its windowed rows (let go long ago): nothing to continue from 10.
        "windowed rows already let go": ([source.backends[1].export_kv(sid, 0, 10)], 10),
    }
    for case, (blobs, end) in refused.items():
        with pytest.raises(SnapshotError):
            target.import_kv(copy, blobs, end)
        assert target.kv_bytes_in_use() == 0, case
    # Nothing was half-imported: the genuine blobs still go in, and the session continues as the source does.
    target.import_kv(copy, [blob], n_prompt)
    fresh.backends[0].import_kv(copy, [head_blob], n_prompt)
    got, expected = Trace(), Trace()
    decode(fresh, copy, n_prompt, token, 4, got)
    decode(source, sid, n_prompt, token, 4, expected)
    assert_same(got, expected)


def tail_export(model: str, n_positions: int, **options: object) -> bytes:
    """The export of a real forward of ``n_positions`` (random hidden states) through layers [3, 6) of ``model``."""
    (backend,) = build_route(model, (3, 6), **options)
    backend.open_session("o", prompt_tokens=[2] * n_positions, sampling=GREEDY)
    hidden = np.random.default_rng(0).standard_normal((n_positions, backend.shard.hidden_size)).astype(np.float32)
    backend.step([StepInput("o", 0, hidden=hidden)])
    return backend.export_kv("o", 0, n_positions)


def test_export_ranges_outside_the_session_are_refused() -> None:
    (backend,) = build_route("tiny-llama", (0, 6))
    ids = backend.tokenize(Prompt(text=SHORT_PROMPT))
    backend.open_session("s", prompt_tokens=ids, sampling=GREEDY)
    with pytest.raises(SessionNotFoundError):
        backend.export_kv("nope", 0, 1)
    with pytest.raises(BadRequestError):
        backend.export_kv("s", 0, 1)  # nothing computed yet
    route = WireRoute([backend])
    sid = route.open(ids)
    feed(route, sid, ids, 0, Trace())
    for start, end in ((0, len(ids) + 1), (3, 3), (-1, 2)):
        with pytest.raises(BadRequestError):
            backend.export_kv(sid, start, end)


# ---- truncate --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "rollback", "cut_back"), [
    ("tiny-llama", 0, 30),  # into the prompt: recomputed in the same 7-position chunks from a chunk boundary
    ("tiny-gemma3", 8, 8),  # the whole rollback margin, past the window
], ids=["llama-into-prompt", "gemma-rollback"])
def test_truncate_then_recompute_gives_identical_logits(model: str, rollback: int, cut_back: int) -> None:
    route = WireRoute(build_route(model, (0, 3, 6), kv_rollback=rollback))
    ids = ids_of(route, LONG_PROMPT)
    n_prompt = len(ids)
    sid = route.open(ids)
    first = Trace()
    token = feed(route, sid, ids, 0, first)
    decode(route, sid, n_prompt, token, 12, first)
    position = n_prompt + 12  # the last sampled token is not fed back
    fed = ids + first.tokens[:-1]
    cut = position - cut_back
    if model == "tiny-llama":
        cut -= cut % 7  # a chunk boundary of the prompt's prefill
        assert cut < n_prompt
    for backend in route.backends:
        backend.truncate(sid, cut)
    if model == "tiny-llama":  # every full layer now holds exactly `cut` positions
        cfg = route.backends[0].prepared.config
        row = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
        assert [b.kv_bytes_in_use() for b in route.backends] == [cut * row * 3, cut * row * 3]

    again = Trace()
    if cut < n_prompt:
        token = feed(route, sid, ids[cut:], cut, again)
        decode(route, sid, n_prompt, token, 12, again)
        assert_same(again, first)
    else:
        decode(route, sid, cut, fed[cut], position - cut, again)
        expected = Trace(first.tokens[-(position - cut):], first.logits[-(position - cut):])
        assert_same(again, expected)
    if rollback:
        # The margin does not change what attention sees: the same stream as a route keeping just the window.
        plain = WireRoute(build_route(model, (0, 3, 6)))
        plain_sid, plain_trace = plain.open(ids), Trace()
        token = feed(plain, plain_sid, ids, 0, plain_trace)
        decode(plain, plain_sid, n_prompt, token, 12, plain_trace)
        assert_same(plain_trace, first)


def test_windowed_layers_refuse_to_go_back_past_what_they_keep() -> None:
    route = WireRoute(build_route("tiny-gemma3", (0, 3, 6), kv_rollback=4))
    ids = ids_of(route, LONG_PROMPT)
    n_prompt = len(ids)
    sid = route.open(ids)
    first = Trace()
    token = feed(route, sid, ids, 0, first)
    token = decode(route, sid, n_prompt, token, 6, first)
    position = n_prompt + 6
    for backend in route.backends:
        before = backend.kv_bytes_in_use()
        with pytest.raises(BadRequestError, match="cannot go back"):
            backend.truncate(sid, position - 5)  # one more than kv_rollback
        with pytest.raises(BadRequestError):
            backend.truncate(sid, position + 1)
        backend.truncate(sid, position)  # a no-op
        assert backend.kv_bytes_in_use() == before
    # Refusals dropped nothing: the session goes on exactly as an untouched one does.
    twin = WireRoute(build_route("tiny-gemma3", (0, 3, 6), kv_rollback=4))
    twin_sid, expected = twin.open(ids), Trace()
    twin_token = feed(twin, twin_sid, ids, 0, expected)
    twin_token = decode(twin, twin_sid, n_prompt, twin_token, 6, expected)
    got, expected = Trace(), Trace()
    decode(route, sid, position, token, 4, got)
    decode(twin, twin_sid, position, twin_token, 4, expected)
    assert_same(got, expected)


def test_below_the_window_truncation_needs_no_rollback() -> None:
    route = WireRoute(build_route("tiny-gemma3", (0, 3, 6)))
    ids = ids_of(route, SHORT_PROMPT)
    n_prompt = len(ids)
    sid = route.open(ids)
    first = Trace()
    token = feed(route, sid, ids, 0, first, chunk=len(ids))
    decode(route, sid, n_prompt, token, 5, first)
    assert n_prompt + 5 < WINDOW
    for backend in route.backends:
        backend.truncate(sid, n_prompt)
    again = Trace()
    decode(route, sid, n_prompt, first.tokens[0], 5, again)
    assert_same(again, Trace(first.tokens[1:], first.logits[1:]))


# ---- prefix reuse ----------------------------------------------------------------------------------------------

def test_copy_prefix_continues_as_a_cold_session_with_that_prompt() -> None:
    route = WireRoute(build_route("tiny-llama", (0, 3, 6), max_sessions=4))
    ids = ids_of(route, LONG_PROMPT)
    source = route.open(ids)
    token = feed(route, source, ids, 0, Trace())
    decode(route, source, len(ids), token, 4, Trace())
    reused_length = 28  # a chunk boundary, so the cold run below takes the same step shapes
    prompt = ids[:reused_length] + ids_of(route, " and a different ending to the story.")[1:]
    for backend in route.backends:
        assert backend.reusable_prefix(source, reused_length) == reused_length
        assert backend.reusable_prefix(source, 10_000) == len(ids) + 4
    warm = route.open(prompt)
    for backend in route.backends:
        backend.copy_prefix(source, warm, reused_length)
        backend.close_session(source)  # copies, not views: the source may go
    got, expected = Trace(), Trace()
    token = feed(route, warm, prompt[reused_length:], reused_length, got)
    decode(route, warm, len(prompt), token, 8, got)
    cold = route.open(prompt)
    token = feed(route, cold, prompt, 0, expected)
    decode(route, cold, len(prompt), token, 8, expected)
    assert_same(got, expected)
    for backend in route.backends:
        with pytest.raises(BadRequestError):
            backend.copy_prefix(cold, warm, 4)  # warm is not empty


@pytest.mark.parametrize("rollback", [0, 6])
def test_windowed_layers_lend_only_prefixes_whose_window_they_still_hold(rollback: int) -> None:
    """Multi-turn reuse: the whole of a finished session (prompt + output), or up to ``kv_rollback`` less."""
    route = WireRoute(build_route("tiny-gemma3", (0, 3, 6), max_sessions=4, kv_rollback=rollback))
    ids = ids_of(route, LONG_PROMPT)
    n_prompt = len(ids)
    source = route.open(ids)
    generated = Trace()
    token = feed(route, source, ids, 0, generated)
    decode(route, source, n_prompt, token, 8, generated)
    held = n_prompt + 8
    length = held - rollback
    for backend in route.backends:
        assert backend.reusable_prefix(source, held + 5) == held
        assert backend.reusable_prefix(source, length) == length
        assert backend.reusable_prefix(source, length - 1) == 0
    history = ids + generated.tokens[:length - n_prompt]
    turn = history + ids_of(route, " What happened next?")[1:]
    warm = route.open(turn)
    for backend in route.backends:
        with pytest.raises(BadRequestError):
            backend.copy_prefix(source, warm, length - 1)
        backend.copy_prefix(source, warm, length)
    got, expected = Trace(), Trace()
    token = feed(route, warm, turn[length:], length, got, chunk=64)
    decode(route, warm, len(turn), token, 6, got)
    # The cold run computes [0, length) as the source did: the prompt in chunks of 7, then one position a step.
    cold = route.open(turn)
    feed(route, cold, ids, 0, Trace())
    for position in range(n_prompt, length):
        route.step([(cold, position, [turn[position]], True)])
    token = feed(route, cold, turn[length:], length, expected, chunk=64)
    decode(route, cold, len(turn), token, 6, expected)
    assert_same(got, expected)


# ---- sampler replay --------------------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.3, seed=5, repeat_penalty=1.3, penalty_last_n=8)


@pytest.mark.parametrize(("model", "rollback"), [("tiny-llama", 0), ("tiny-gemma3", 12)])
def test_a_rebuilt_or_cut_back_tail_continues_a_seeded_stream_unchanged(model: str, rollback: int) -> None:
    """Repair's two paths: a replacement imports a snapshot and replays the sampled tokens; a surviving tail is
    cut back and replays. Either way the seeded stream is the one the uninterrupted session drew."""
    source = WireRoute(build_route(model, (0, 3, 6), kv_rollback=rollback))
    ids = ids_of(source, LONG_PROMPT)
    n_prompt = len(ids)
    sid = source.open(ids, SEEDED)
    stream = Trace()
    token = feed(source, sid, ids, 0, stream)
    token = decode(source, sid, n_prompt, token, 8, stream)
    snapshot_at = n_prompt + 8
    blobs = [backend.export_kv(sid, 0, snapshot_at) for backend in source.backends]
    decode(source, sid, snapshot_at, token, 10, stream)
    sampled_so_far, rest = stream.tokens[:9], Trace(stream.tokens[9:], stream.logits[9:])

    rebuilt = WireRoute(build_route(model, (0, 3, 6), kv_rollback=rollback))
    copy = rebuilt.open(ids, SEEDED)
    for backend, blob in zip(rebuilt.backends, blobs, strict=True):
        backend.import_kv(copy, [blob], snapshot_at)
    tail(rebuilt).replay_sampled(copy, sampled_so_far)
    got = Trace()
    decode(rebuilt, copy, snapshot_at, sampled_so_far[-1], 10, got)
    assert_same(got, rest)

    for backend in source.backends:
        backend.truncate(sid, snapshot_at)
    tail(source).replay_sampled(sid, sampled_so_far)
    again = Trace()
    decode(source, sid, snapshot_at, sampled_so_far[-1], 10, again)
    assert_same(again, rest)

    # The replay is what makes them agree: a sampler left as at open draws another stream from the same KV.
    unreplayed = WireRoute(build_route(model, (0, 3, 6), kv_rollback=rollback))
    other = unreplayed.open(ids, SEEDED)
    for backend, blob in zip(unreplayed.backends, blobs, strict=True):
        backend.import_kv(other, [blob], snapshot_at)
    drift = Trace()
    decode(unreplayed, other, snapshot_at, sampled_so_far[-1], 10, drift)
    assert drift.tokens != rest.tokens


def test_replay_sampled_is_the_tails_alone() -> None:
    head, tail_backend = build_route("tiny-llama", (0, 3, 6))
    for backend in (tail_backend, head):
        backend.open_session("s", prompt_tokens=[2, 5], sampling=SEEDED)
    with pytest.raises(BadRequestError):
        head.replay_sampled("s", [5])
    with pytest.raises(SessionNotFoundError):
        tail_backend.replay_sampled("nope", [5])
    tail_backend.replay_sampled("s", [5, 6])
