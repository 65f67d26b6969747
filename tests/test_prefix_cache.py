"""actors.node.prefix_cache and schemas.prefix: what a node keeps for reuse, what a prompt reuses of it, and the
keys that name it (issue #18)."""

from __future__ import annotations

from actors.node.prefix_cache import Kept, PrefixCache, common_prefix, reusable
from schemas.prefix import TEXT_BLOCK, conversation_keys, message_keys, request_keys, text_keys


def kept(tokens: list[int], chunk: int = 4, *, piece: int = 10) -> Kept:
    pieces = [bytes(piece) for _ in range(0, len(tokens), chunk)]
    return Kept(tokens=tokens, pieces=pieces, chunk=chunk)


def test_reuse_is_whole_chunks_and_leaves_the_last_prompt_token() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    assert reusable(shared=10, prompt=20) == 10 and reusable(shared=20, prompt=20) == 19  # token-exact: chunk 1
    assert reusable(shared=10, prompt=20, chunk=4) == 8
    assert reusable(shared=20, prompt=20, chunk=4) == 16  # the same prompt again: its last chunk is computed
    assert reusable(shared=21, prompt=21, chunk=4) == 20
    assert reusable(shared=3, prompt=20, chunk=4) == 0


def test_the_longest_match_wins_down_to_the_token_and_superseded_entries_go() -> None:
    cache = PrefixCache(max_entries=4, max_bytes=10_000)
    cache.keep("a", kept(list(range(12))))
    cache.keep("b", kept([9, 9, 9, 9, 9]))
    match = cache.match([*range(12), 50, 51])
    assert match is not None and match[2] == 12 and match[0] == "a" and match[1].tokens == list(range(12))
    diverging = cache.match([*range(7), 99, 98])  # diverges after 7 tokens: exactly those are reused
    assert diverging is not None and diverging[0] == "a" and diverging[2] == 7
    again = cache.match([9, 9, 9, 9, 9])  # the same prompt again: all but its last token
    assert again is not None and again[0] == "b" and again[2] == 4
    assert cache.match([5, 1]) is None
    gone = cache.keep("c", kept(list(range(20))))  # holds all "a" held
    assert len(cache) == 2 and cache.get("a") is None and [name for name, _ in gone] == ["a"]


def test_a_resident_entry_wins_a_tie_and_every_entry_checks_its_hashes() -> None:
    cache = PrefixCache(max_entries=4, max_bytes=10_000)
    cache.keep("host", kept([1, 2, 3, 4, 5, 6]))
    cache.keep("parked", Kept(tokens=[1, 2, 3, 4, 5, 7], pieces=[], chunk=4, resident=True))
    match = cache.match([1, 2, 3, 4, 5, 8])
    assert match is not None and match[0] == "parked" and match[2] == 5
    host = cache.get("host")
    assert host is not None and host.intact(6) and host.intact(3)
    host.pieces[1] = b"x" * 10  # the second piece (positions 4..) no longer what was kept
    assert host.intact(4) and not host.intact(5)
    host.tokens[0] = 42
    assert not host.intact(1)
    parked = cache.get("parked")
    assert parked is not None and parked.intact(5) and parked.size == 0
    parked.with_pieces([b"ab", b"cd"])  # demoted to host memory
    assert not parked.resident and parked.intact(5) and parked.size == 4 and cache.resident() == []


def test_entries_go_oldest_first_within_the_budgets() -> None:
    cache = PrefixCache(max_entries=2, max_bytes=10_000)
    for name, first in (("a", 1), ("b", 2), ("c", 3)):
        cache.keep(name, kept([first] * 8))
    assert cache.get("a") is None and cache.evicted == 1
    small = PrefixCache(max_entries=10, max_bytes=25)
    small.keep("a", kept([1] * 8))  # 20 bytes
    small.keep("b", kept([2] * 8))
    assert small.get("a") is None and small.bytes_used == 20
    small.keep("huge", kept([3] * 40))  # alone over the budget: not kept, nothing evicted for it
    assert small.get("huge") is None and small.get("b") is not None
    assert not PrefixCache(max_entries=0, max_bytes=100).enabled


def test_keys_chain_over_messages_and_text_blocks() -> None:
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert message_keys(turn2)[:2] == message_keys(turn1)
    assert conversation_keys(turn1, None, "hello")[-1] == message_keys(turn2)[2]
    assert message_keys([{"role": "user", "content": "hi"}]) != message_keys([{"role": "user", "content": "ho"}])
    text = "x" * (3 * TEXT_BLOCK + 10)
    assert len(text_keys(text)) == 3 and text_keys(text)[:2] == text_keys(text[:2 * TEXT_BLOCK])
    assert request_keys(None, text) == text_keys(text) and request_keys(turn1, None) == message_keys(turn1)
    assert conversation_keys(None, text[:TEXT_BLOCK * 2], text[TEXT_BLOCK * 2:])[-1] == text_keys(text)[-1]


def test_a_node_advertises_the_most_recent_entries_keys_first() -> None:
    cache = PrefixCache(max_entries=4, max_bytes=10_000)
    cache.keep("a", kept([1] * 8))
    cache.keep("b", kept([2] * 8))
    assert cache.attach_keys("a", ["a1", "a2"]) and cache.attach_keys("b", ["b1"])
    assert not cache.attach_keys("zzz", ["k"])
    assert cache.keys() == ["b1", "a2", "a1"]
