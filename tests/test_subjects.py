"""bus.subjects: every subject is namespace-first, identifiers last, and identifiers are validated tokens."""

from __future__ import annotations

import pytest

from bus.subjects import Subjects

BAD_TOKENS = ["", "a.b", "a b", "a*", ">x", "$SYS", "ünï", "a\tb", "a/b"]


def test_default_namespace_subjects() -> None:
    s = Subjects()
    assert s.route_request == "swarmroute.tracker.route"
    assert s.models_request == "swarmroute.tracker.models"
    assert s.registry_bucket == "swarmroute_nodes"
    assert s.registry_key_subject() == "$KV.swarmroute_nodes.*"
    assert s.registry_key_subject("n1") == "$KV.swarmroute_nodes.n1"
    assert s.telemetry("abc") == "swarmroute.telemetry.abc"
    assert s.telemetry() == "swarmroute.telemetry.*"
    assert s.telemetry_all == "swarmroute.telemetry.>"
    assert s.tokens("abc") == "swarmroute.tokens.abc"
    assert s.session_events("abc") == "swarmroute.*.abc"
    assert s.client("abc") == "swarmroute.client.abc"  # inside session_events' wildcard: the client answers it
    assert s.node_events() == "swarmroute.node.*.events"
    assert s.artifact_peer_query("m1") == "swarmroute.artifacts.who.m1"


def test_namespace_prefixes_everything() -> None:
    s = Subjects("prod-eu_1")
    subjects = [s.route_request, s.models_request, s.telemetry("x"), s.telemetry_all, s.tokens("x"),
                s.session_events("x"), s.client("x"), s.node_events("n"), s.artifact_progress("n"),
                s.artifact_peers("m"), s.artifact_peer_query("m"), s.artifact_manifest("m")]
    assert all(subject.startswith("prod-eu_1.") for subject in subjects)
    assert s.registry_bucket == "prod-eu_1_nodes"


@pytest.mark.parametrize("bad", BAD_TOKENS)
def test_bad_namespace_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="namespace .* is not a valid subject token"):
        Subjects(bad)


@pytest.mark.parametrize("bad", BAD_TOKENS)
def test_bad_identifiers_rejected_everywhere(bad: str) -> None:
    s = Subjects()
    for make in (s.telemetry, s.tokens, s.session_events, s.client, s.node_events, s.artifact_progress,
                 s.artifact_peers, s.artifact_peer_query, s.artifact_manifest):
        with pytest.raises(ValueError, match="is not a valid subject token"):
            make(bad)


def test_wildcards_only_where_a_subscriber_may_use_them() -> None:
    s = Subjects()
    assert s.telemetry(">") == "swarmroute.telemetry.>"
    assert s.node_events("*") == "swarmroute.node.*.events"
    # Subjects a session or request is addressed to never take a wildcard: a publish there would be invalid.
    for make in (s.session_events, s.client, s.artifact_peer_query, s.artifact_manifest):
        for wild in ("*", ">"):
            with pytest.raises(ValueError):
                make(wild)


def test_registry_key_subject_rejects_bad_node_id() -> None:
    with pytest.raises(ValueError):
        Subjects().registry_key_subject("a.b")
