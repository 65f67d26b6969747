"""Who checks, who is evicted (issue #28): the tracker's pure decisions, and the bucket on a real nats-server."""

from __future__ import annotations

import random
from typing import Any

import nats

from actors.tracker.evictions import Evictions, decide, open_evictions, pick_checker, stale
from bus.subjects import Subjects
from schemas.node import BackendInfo, Capacity, LayerRange, NodeAdvertisement
from schemas.spot_check import CheckerRequest, Dispute, Eviction, SpotVerdict
from tests.support.waiting import eventually

L = LayerRange(start=0, end=6)


def advert(node: str, layers: LayerRange = L, build: str = "b1") -> NodeAdvertisement:
    return NodeAdvertisement(node_id=node, endpoint=f"http://127.0.0.1:1/{node}", model_id="m", layers=layers,
                             is_head=layers.start == 0, is_tail=False, build_id=build,
                             backend=BackendInfo(kind="stub", n_layers=12, hidden_size=4, hidden_shape=[4],
                                                 context_length=64),
                             capacity=Capacity(max_sessions=2, max_context=64))


def verdict(node: str, agree: bool) -> SpotVerdict:
    return SpotVerdict(node_id=node, agree=agree, exact=agree, rule="band", positions=8, judged=8, max_rel_err=0.0,
                       min_top_k=1.0)


def test_the_checker_serves_the_same_layers_is_not_the_checked_node_and_prefers_its_build_then_family() -> None:
    adverts = [advert("a"), advert("b", build="b2"), advert("c"), advert("d", LayerRange(start=6, end=12)),
               advert("e")]
    request = CheckerRequest(model_id="m", layers=L, exclude=["a"], build_id="b1")
    chosen = {pick_checker(adverts, request, evicted={"e"}, rng=random.Random(i)).node_id for i in range(20)}
    assert chosen == {"c"}
    other_build = pick_checker(adverts, request.model_copy(update={"build_id": "b9"}), evicted={"e"})
    assert other_build.node_id in {"b", "c"}
    family = [advert("f", build="b3").model_copy(update={"kernels_id": "k1"}), advert("g", build="b4")]
    across = request.model_copy(update={"build_id": "b9", "kernels_id": "k1"})
    chosen = {pick_checker([*adverts, *family], across, evicted={"e"}, rng=random.Random(i)).node_id
              for i in range(20)}
    assert chosen == {"f"}  # no node of its build: one of its kernel family, for the narrow band
    none = pick_checker(adverts, request.model_copy(update={"exclude": ["a", "b", "c"]}), evicted={"e"})
    assert none.node_id == "" and none.status == 503 and "no other node" in none.error


def test_the_referee_decides_who_is_wrong() -> None:
    adverts = [advert("a"), advert("b"), advert("c")]
    both = Dispute(session_id="s", model_id="m", layers=L, checked="a", checker=verdict("b", False),
                   referee=verdict("c", False))
    assert decide(both, adverts)[0] == "a"
    sided = both.model_copy(update={"referee": verdict("c", True)})
    assert decide(sided, adverts)[0] == "b"
    assert decide(both.model_copy(update={"referee": verdict("a", False)}), adverts) == \
        ("", "the referee must be a third node")
    assert decide(both.model_copy(update={"checker": verdict("b", True)}), adverts)[0] == ""
    stranger = both.model_copy(update={"referee": verdict("z", False)})
    assert decide(stranger, adverts)[0] == ""
    # A referee that could compare nothing (every pass shared its batch) "agrees" by default: nobody is evicted.
    unjudged = verdict("c", True).model_copy(update={"rule": "wide", "judged": 0})
    assert decide(both.model_copy(update={"referee": unjudged}), adverts) == \
        ("", "the referee could not judge the receipt (no position it could compare)")


def test_only_work_from_before_the_latest_clear_is_stale() -> None:
    dispute = Dispute(session_id="s", model_id="m", layers=L, checked="a", checker=verdict("b", False),
                      referee=verdict("c", False))
    assert not stale(dispute, 1)  # a generation not known: judged
    assert stale(dispute.model_copy(update={"clearance": 0}), 1)
    assert not stale(dispute.model_copy(update={"clearance": 1}), 1)


async def test_an_eviction_is_kept_announced_listed_and_cleared(nats_server: Any) -> None:
    subjects = Subjects("evt")
    nc = await nats.connect(nats_server.url)
    try:
        seen: list[Eviction] = []

        async def note(msg: Any) -> None:
            from bus import codec

            seen.append(codec.decode(msg.data, Eviction))

        await nc.subscribe(subjects.evictions(), cb=note)
        tracker = Evictions(nc, subjects, await open_evictions(nc, subjects))
        await tracker.start()
        operator = Evictions(nc, subjects, await open_evictions(nc, subjects))
        await operator.evict(Eviction(node_id="bad", model_id="m", layers=L, reason="wrong"))
        await eventually(lambda: "bad" in tracker.evicted, timeout=5, what="the tracker seeing the eviction")
        assert [e.node_id for e in await operator.listing()] == ["bad"]
        assert (await operator.clear("bad")) is not None
        assert await operator.clear("bad") is None
        await eventually(lambda: "bad" not in tracker.evicted, timeout=5, what="the tracker seeing the clear")
        await eventually(lambda: [e.cleared for e in seen] == [False, True], timeout=5, what="both notes")
        assert await operator.listing() == [] and tracker.clearance("bad") == 1 and seen[1].clearance == 1
        # Evicted again: the generation is kept through it, and the next clear counts on.
        await operator.evict(Eviction(node_id="bad", model_id="m", layers=L, reason="wrong again"))
        await eventually(lambda: "bad" in tracker.evicted, timeout=5, what="the second eviction")
        assert tracker.evicted["bad"].clearance == 1
        await operator.clear("bad")
        await eventually(lambda: tracker.clearance("bad") == 2, timeout=5, what="the second clear")
        await tracker.stop()
    finally:
        await nc.close()
