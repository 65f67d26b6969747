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
    assert reusable(shared=10, prompt=20, chunk=4) == 8
    assert reusable(shared=20, prompt=20, chunk=4) == 16  # the same prompt again: its last chunk is computed
    assert reusable(shared=21, prompt=21, chunk=4) == 20
    assert reusable(shared=3, prompt=20, chunk=4) == 0


def test_the_longest_match_wins_and_superseded_entries_go() -> None:
    cache = PrefixCache(max_entries=4, max_bytes=10_000)
    cache.keep("a", kept(list(range(12))))
    cache.keep("b", kept([9, 9, 9, 9, 9]))
    match = cache.match([*range(12), 50, 51], chunk=4)
    assert match is not None and match[1] == 12 and match[0].tokens == list(range(12))
    assert cache.match([9, 9, 9, 9, 9, 1], chunk=8) is None  # kept with chunks of 4
    cache.keep("c", kept(list(range(20))))  # holds all "a" held
    assert len(cache) == 2 and cache.get("a") is None


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
