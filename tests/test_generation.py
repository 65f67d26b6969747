"""actors.node.generation: what the tail releases as text, token by token, and when and why generation ends.

Tokens here are byte strings (a toy vocabulary built per test), so a test can split a UTF-8 character or a stop
string across tokens at will; the expected output is always derived from the joined bytes in the same test.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.node.generation import Generation, StopMatcher

EOS = -1


def make(pieces: list[bytes], *, max_tokens: int = 1000, stops: list[str] | None = None,
         ignore_eos: bool = False) -> tuple[Generation, list[int]]:
    """A Generation over a vocabulary where token i is pieces[i]; returns it and the token ids in order."""
    vocab = dict(enumerate(pieces))
    gen = Generation(max_tokens=max_tokens, stops=stops or [], ignore_eos=ignore_eos,
                     token_bytes=lambda t: vocab.get(t, b""), is_eog=lambda t: t == EOS)
    return gen, list(range(len(pieces)))


def run(gen: Generation, tokens: list[int]) -> tuple[list[str], str | None]:
    outs: list[str] = []
    for t in tokens:
        text, finish = gen.accept(t)
        outs.append(text)
        if finish is not None:
            return outs, finish
    return outs, None


def test_plain_text_passes_through_token_by_token() -> None:
    pieces = [b"Hel", b"lo", b", ", b"world"]
    gen, tokens = make(pieces)
    outs, finish = run(gen, tokens)
    assert outs == [p.decode() for p in pieces]
    assert finish is None and not gen.done


def test_multibyte_character_split_across_tokens_is_never_split() -> None:
    text = "aé✓😀z"
    raw = text.encode()
    pieces = [bytes([b]) for b in raw]  # every byte its own token: every character split as far as possible
    gen, tokens = make(pieces)
    outs, _ = run(gen, tokens)
    assert "".join(outs) == text
    for out in outs:
        assert "\ufffd" not in out
        out.encode("utf-8")  # each piece is whole characters on its own
    # A character appears on the token that completes it, not before.
    assert outs[:3] == ["a", "", "é"]


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=30), cuts=st.lists(st.integers(1, 120), max_size=20))
def test_any_byte_split_reassembles_exactly_with_whole_characters(text: str, cuts: list[int]) -> None:
    raw = text.encode()
    points = sorted({c for c in cuts if c < len(raw)})
    pieces = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]
    gen, tokens = make(pieces)
    outs, _ = run(gen, tokens)
    assert "".join(outs) == text
    assert all("\ufffd" not in o for o in outs) or "\ufffd" in text


def test_stop_string_split_across_tokens_is_cut_exactly_and_never_leaks() -> None:
    pieces = [b"The answer", b" is 4", b"2.\n", b"##", b"#", b" END", b" more"]
    stop = "\n### END"
    full = b"".join(pieces).decode()
    expected = full[: full.index(stop)]
    gen, tokens = make(pieces, stops=[stop])
    outs, finish = run(gen, tokens)
    assert finish == "stop" and gen.finish_reason == "stop"
    assert "".join(outs) == expected
    # Nothing that belongs to the stop string was ever released, not even its first characters.
    released = ""
    for out in outs:
        released += out
        assert stop[:1] not in released[len(expected):]
        assert len(released) <= len(expected)


def test_partial_match_that_does_not_complete_is_released() -> None:
    pieces = [b"ab", b"c", b"X", b"zab", b""]
    gen, tokens = make(pieces, stops=["abcd"])
    outs, finish = run(gen, tokens)
    assert finish is None
    # Held while it could still become "abcd", released the moment it cannot; a new "ab" is held again.
    assert outs == ["", "", "abcX", "z", ""]
    assert gen.accept(EOS) == ("ab", "stop")


def test_earliest_of_several_stops_wins() -> None:
    pieces = [b"one two three"]
    full = pieces[0].decode()
    gen, tokens = make(pieces, stops=["three", "two", "zzz"])
    outs, finish = run(gen, tokens)
    assert finish == "stop"
    assert "".join(outs) == full[: full.index("two")]


def test_stop_that_overlaps_itself() -> None:
    pieces = [b"a", b"a", b"a", b"b", b"tail"]
    gen, tokens = make(pieces, stops=["aab"])
    outs, finish = run(gen, tokens)
    assert finish == "stop"
    assert "".join(outs) == "a"


def test_stop_string_with_multibyte_characters_split_mid_character() -> None:
    stop = "→é"
    raw = ("x→" + "y" + stop + "z").encode()
    pieces = [bytes([b]) for b in raw]
    gen, tokens = make(pieces, stops=[stop])
    outs, finish = run(gen, tokens)
    assert finish == "stop"
    assert "".join(outs) == "x→y"


def test_eos_finishes_with_stop_and_adds_no_text() -> None:
    gen, tokens = make([b"hi", b" there"])
    assert run(gen, tokens) == (["hi", " there"], None)
    text, finish = gen.accept(EOS)
    assert (text, finish) == ("", "stop")
    assert gen.done and gen.count == 3
    with pytest.raises(RuntimeError, match="already finished"):
        gen.accept(0)


def test_eos_releases_text_held_for_a_stop_that_never_completed() -> None:
    gen, tokens = make([b"wait: ##"], stops=["###"])
    outs, _ = run(gen, tokens)
    assert outs == ["wait: "]
    assert gen.accept(EOS) == ("##", "stop")


def test_eos_after_incomplete_character_keeps_text_order() -> None:
    # "ab" is held (could become the stop "abc"), then half of "é" arrives, then EOS: held text comes first.
    gen, tokens = make([b"ab", "é".encode()[:1]], stops=["abc"])
    outs, _ = run(gen, tokens)
    assert outs == ["", ""]
    text, finish = gen.accept(EOS)
    assert finish == "stop"
    assert text == "ab\ufffd"


def test_max_tokens_finishes_with_length_and_flushes_held_text() -> None:
    pieces = [b"x", b"y", b"ab"]  # "ab" is a prefix of the stop, held until the limit ends generation
    gen, tokens = make(pieces, max_tokens=3, stops=["abc"])
    outs, finish = run(gen, tokens)
    assert finish == "length"
    assert "".join(outs) == "xyab"
    assert outs[-1] == "ab"


def test_max_tokens_flushes_an_incomplete_character_as_replacement() -> None:
    gen, tokens = make([b"ok", "✓".encode()[:2]], max_tokens=2)
    outs, finish = run(gen, tokens)
    assert finish == "length"
    assert "".join(outs) == "ok\ufffd"


def test_stop_on_the_last_allowed_token_reports_stop() -> None:
    gen, tokens = make([b"a", b"STOP"], max_tokens=2, stops=["STOP"])
    outs, finish = run(gen, tokens)
    assert (outs, finish) == (["a", ""], "stop")


def test_ignore_eos_keeps_generating_until_length() -> None:
    gen, _ = make([b"a"], max_tokens=4, ignore_eos=True)
    results = [gen.accept(t) for t in (0, EOS, 0, EOS)]
    assert [finish for _, finish in results] == [None, None, None, "length"]
    assert "".join(text for text, _ in results) == "aa"


def test_stop_matcher_without_stops_releases_everything() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_stop_matcher_ignores_empty_stop_strings() -> None:
    m = StopMatcher(["", "zz"])
    assert m.feed("abz") == ("ab", False)
    assert m.feed("z!") == ("", True)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab\nXé", max_size=40), stop=st.text(alphabet="ab\nXé", min_size=1, max_size=4),
       cuts=st.lists(st.integers(1, 40), max_size=15))
def test_stop_property_output_is_exact_prefix_and_never_overshoots(text: str, stop: str, cuts: list[int]) -> None:
    points = sorted({c for c in cuts if c < len(text)})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    m = StopMatcher([stop])
    released, stopped = "", False
    for chunk in chunks:
        out, stopped = m.feed(chunk)
        released += out
        expected_final = text[: text.index(stop)] if stop in text else text
        assert expected_final.startswith(released)  # never releases anything beyond the cut point
        if stopped:
            break
    if stop in text:
        assert stopped and released == text[: text.index(stop)]
    else:
        assert not stopped and released + m.flush() == text
