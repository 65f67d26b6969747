"""swarmroute/watch.py: what ``swarmroute watch`` shows of nodes coming up."""

from __future__ import annotations

from schemas.artifact import FetchProgress
from schemas.node import BackendInfo, Capacity, FetchSummary, LayerRange, NodeAdvertisement
from swarmroute.watch import render


def advert(node_id: str, state: str, endpoint: str) -> NodeAdvertisement:
    return NodeAdvertisement(node_id=node_id, endpoint=endpoint, model_id="m" * 64, layers=LayerRange(start=0, end=9),
                             is_head=True, is_tail=False, backend=BackendInfo(kind="llamacpp", n_layers=18,
                                                                              hidden_size=8, hidden_shape=[8],
                                                                              context_length=64),
                             capacity=Capacity(max_sessions=4, max_context=64), state=state,
                             fetch=FetchSummary(phase="fetching") if state == "fetching" else None)


def test_fetching_nodes_are_marked_and_their_progress_shown() -> None:
    nodes = {"a": advert("a", "serving", "http://10.0.0.2:9000"), "b": advert("b", "fetching", "")}
    fetches = {"b": FetchProgress(node_id="b", model_id="m", start=9, end=18, phase="fetching", pieces_done=10,
                                  pieces_wanted=40, bytes_downloaded=10, bytes_needed=40, peers=2, eta_s=30.0)}
    text = render(nodes, {}, fetches)
    assert "http://10.0.0.2:9000" in text and "(fetching: not routed yet)" in text
    assert "FETCHING" in text and "[9,18) fetching" in text and "ETA 30s" in text
    assert "FETCHING" not in render(nodes, {})
