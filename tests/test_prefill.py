"""actors.node.prefill.step_starts: where a head's prefill steps start (chunks, and a short prompt's sub-chunks on a
route, issue #26)."""

from __future__ import annotations

import pytest

from actors.node.prefill import MIN_SUBCHUNK, ROW_GROUP, step_starts


@pytest.mark.parametrize(("first", "total", "chunk", "hops", "subchunks", "expected"), [
    (0, 10, 256, 2, 2, [0, 4]),  # a short prompt on 2 hops: two parts, the hops overlap; ROW_GROUP-aligned
    (0, 11, 256, 2, 2, [0, 4]),  # the later sub-chunk never the smaller
    (0, 30, 256, 3, 3, [0, 8, 20]),  # one per hop
    (0, 30, 256, 3, 2, [0, 12]),  # at most ``subchunks``
    (0, 10, 256, 2, 1, [0]),  # off
    (0, 10, 256, 1, 2, [0]),  # one node: nothing to overlap
    (0, 2 * MIN_SUBCHUNK - 1, 256, 2, 2, [0]),  # too short to pay for a pass and a link more
    (0, 600, 256, 2, 2, [0, 256, 512]),  # a long prompt: its chunks pipeline already, as a cold run's
    (300, 310, 256, 2, 2, [300, 304]),  # what reuse left of a long prompt, one step: split
    (300, 600, 256, 2, 2, [300, 512]),  # reuse: the first step ends on a cold run's chunk boundary
    (10, 10, 256, 2, 2, []),  # nothing left to compute
])
def test_steps_start_on_chunk_boundaries_and_a_one_step_prompt_is_split_between_the_hops(
        first: int, total: int, chunk: int, hops: int, subchunks: int, expected: list[int]) -> None:
    assert step_starts(first, total, chunk, hops, subchunks) == expected


def test_every_sub_chunk_starts_a_whole_number_of_row_groups_into_its_step() -> None:
    for total in range(2 * MIN_SUBCHUNK, 200):
        for hops in (2, 3, 4):
            starts = step_starts(100, 100 + total, 256, hops, hops)
            assert all((s - 100) % ROW_GROUP == 0 for s in starts), (total, hops, starts)
