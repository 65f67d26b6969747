"""actors/provisioning/leases.py on a real nats-server: create-if-absent per range slot, renewal against a revision,
release,
expiry with the TTL, and a node's keeper taking a lapsed lease back."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.provisioning.leases import LeaseKeeper, lease_key, open_leases
from bus.subjects import Subjects
from schemas.assignment import RangeLease
from schemas.settings import Settings

MODEL, OTHER = "a" * 64, "b" * 64


def lease(node: str, start: int, end: int, model: str = MODEL, slot: int = 0) -> RangeLease:
    return RangeLease(node_id=node, model_id=model, start=start, end=end, slot=slot)


async def test_a_range_slot_has_one_holder_and_replicas_take_the_next_slot(nc: Any, settings: Settings) -> None:
    leases = await open_leases(nc, Subjects(settings.namespace), ttl_s=30)
    first = await leases.take(lease("n1", 0, 9))
    assert first is not None and first[0] == lease_key(MODEL, 0, 9, 0)
    assert await leases.take(lease("n2", 0, 9)) is None  # the same slot at the same moment: one winner
    replica, key, _ = await leases.take_free_slot(lease("n2", 0, 9))
    assert replica.slot == 1 and key == lease_key(MODEL, 0, 9, 1)
    await leases.take(lease("n3", 0, 4, model=OTHER))
    held = await leases.held(MODEL)
    assert {k: (v.node_id, v.slot) for k, (v, _) in held.items()} == {lease_key(MODEL, 0, 9, 0): ("n1", 0),
                                                                     lease_key(MODEL, 0, 9, 1): ("n2", 1)}
    assert held[first[0]][1] == first[1]  # revisions, for renewals
    await leases.release(first[0])
    assert set(await leases.held(MODEL)) == {key}
    again = await leases.take(lease("n4", 0, 9))  # a released slot is free again
    assert again is not None and again[0] == first[0]


async def test_leases_expire_unless_renewed_against_their_revision(nc: Any, settings: Settings) -> None:
    leases = await open_leases(nc, Subjects(settings.namespace), ttl_s=1.0)
    taken = await leases.take(lease("n1", 0, 9))
    assert taken is not None
    key, revision = taken
    for _ in range(4):
        await asyncio.sleep(0.4)
        revision = await leases.renew(key, lease("n1", 0, 9), revision)
    assert key in await leases.held(MODEL)  # 1.6 s: alive only because it was renewed
    await asyncio.sleep(2.0)
    assert await leases.held(MODEL) == {}


async def test_a_keeper_renews_and_takes_a_lapsed_lease_back(nc: Any, settings: Settings) -> None:
    leases = await open_leases(nc, Subjects(settings.namespace), ttl_s=1.0)
    mine = lease("n1", 3, 6)
    taken = await leases.take(mine)
    assert taken is not None
    keeper = LeaseKeeper(leases, mine, *taken, interval_s=0.2, timeout_s=1.0).start()
    await asyncio.sleep(1.5)
    assert set(await leases.held(MODEL)) == {taken[0]}
    # the lease lapses (e.g. the node was paused past the TTL) and another node takes its slot meanwhile
    await leases.release(taken[0])
    assert await leases.take(lease("n2", 3, 6)) is not None
    await asyncio.sleep(0.6)
    held = {v.node_id: v.slot for v, _ in (await leases.held(MODEL)).values()}
    assert held == {"n2": 0, "n1": 1}  # n1 still holds the range, in the next slot
    await keeper.release()
    await keeper.release()  # safe twice
    assert {v.node_id for v, _ in (await leases.held(MODEL)).values()} == {"n2"}
