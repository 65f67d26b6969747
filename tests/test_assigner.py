"""actors/tracker/assigner.py: what the assignment sees of a model (its manifest) and of the swarm (claims from
advertisements and leases). The endpoint itself runs against real NATS in tests/test_tracker.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.tracker.assigner import claims_of, fit_from_manifest
from artifacts.manifest import build_manifest
from schemas.assignment import RangeLease
from schemas.node import BackendInfo, Capacity, LayerRange, NodeAdvertisement

MODEL = "c" * 64


def advert(node: str, a: int, b: int, *, state: str = "serving", verified: bool = True, active: int = 0,
           model: str = MODEL) -> NodeAdvertisement:
    return NodeAdvertisement(node_id=node, endpoint="http://10.0.0.2:9000", model_id=model,
                             layers=LayerRange(start=a, end=b), is_head=a == 0, is_tail=b == 18,
                             backend=BackendInfo(kind="llamacpp", n_layers=18, hidden_size=8, hidden_shape=[8],
                                                 context_length=64),
                             capacity=Capacity(max_sessions=4, active_sessions=active, max_context=64),
                             verified=verified, state=state)


def lease(node: str, a: int, b: int) -> tuple[RangeLease, int]:
    return RangeLease(node_id=node, model_id=MODEL, start=a, end=b), 1


def test_claims_come_from_serving_and_fetching_nodes_and_bare_leases() -> None:
    adverts = [advert("s", 0, 9, active=3), advert("f", 9, 18, state="fetching", verified=False),
               advert("unverified", 0, 18, verified=False), advert("future", 0, 18, state="draining"),
               advert("other", 0, 18, model="d" * 64), advert("me", 0, 18)]
    leases = {"k1": lease("s", 0, 9), "k2": lease("joining", 4, 12), "k3": lease("me", 0, 4)}
    claims = {c.node_id: c for c in claims_of(adverts, leases, MODEL, asking="me")}
    assert set(claims) == {"s", "f", "joining"}
    assert claims["s"].serving and claims["s"].active_sessions == 3 and claims["s"].max_sessions == 4
    assert not claims["f"].serving and claims["f"].max_sessions == 0  # a fetching node carries no load yet
    assert (claims["joining"].start, claims["joining"].end, claims["joining"].serving) == (4, 12, False)


@pytest.mark.slow
def test_the_model_fit_refuses_what_llama_cpp_cannot_run(gemma_path: Path) -> None:
    fit = fit_from_manifest(build_manifest(gemma_path), context=4096, sessions=4, allow_unproven=False)
    assert fit.n_layers == 18 and fit.allowed(0, 18) and fit.allowed(6, 12)
    assert not fit.allowed(17, 18)  # Gemma 3: layer 17 is global, a shard needs a sliding layer
    assert fit.cost(0, 9) > fit.cost(9, 17)  # the head carries the 178 MB embedding
    assert fit.cost(9, 18) > fit.cost(9, 17)  # and so does the tail (tied lm_head)
    assert fit.cut_sets[0] == (6, 12, 18) and fit.cut_sets[-1] == tuple(range(1, 19))
