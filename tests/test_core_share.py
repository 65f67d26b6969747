"""How ``up``'s local nodes share the cores (swarmroute/core_share.py, issue #26 item 4): the choice from measured
rates, their cache, and the measuring child on the real bundled model. A recorded measure function stands in for
the child where the decision is what is tested (the child itself is tested on its own)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarmroute.core_share import MARGIN, ROUNDS, choose, measure_in_child


class Rates:
    """A measure function with fixed rates per (threads, passive), counting its calls."""

    def __init__(self, rates: dict[tuple[int, bool], float]) -> None:
        self.rates = rates
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, model: Path, threads: int, passive: bool) -> float:
        self.calls.append((threads, passive))
        return self.rates[(threads, passive)]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def test_every_core_with_the_passive_wait_is_chosen_only_for_a_clear_win(model: Path, tmp_path: Path) -> None:
    epyc = Rates({(1, False): 27.2, (2, True): 37.1})  # one llama.cpp process on the 2-core EPYC (docs)
    chosen = choose(model, 2, 2, cache=tmp_path / "a.json", measure=epyc)
    assert chosen.threads == 2 and "passive wait" in chosen.why and "measured now" in chosen.why
    assert epyc.calls == [(1, False), (2, True)] * ROUNDS  # interleaved, each wait in its own child
    xeon = Rates({(1, False): 28.8, (2, True): 24.4})
    assert choose(model, 2, 2, cache=tmp_path / "b.json", measure=xeon).threads == 1
    close = Rates({(1, False): 30.0, (2, True): 30.0 * MARGIN * 0.99})
    assert choose(model, 2, 2, cache=tmp_path / "c.json", measure=close).threads == 1  # within noise: the share


def test_a_measurement_is_kept_per_model_file_and_cpu(model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "core-share.json"
    first = Rates({(2, False): 50.0, (4, True): 80.0})
    assert choose(model, 2, 4, cache=cache, measure=first).threads == 4
    again = Rates({})
    kept = choose(model, 2, 4, cache=cache, measure=again)
    assert kept.threads == 4 and again.calls == [] and str(cache) in kept.why
    os.utime(model, ns=(1, 1))  # another file at that path: measured anew
    assert choose(model, 2, 4, cache=cache, measure=Rates({(2, False): 50.0, (4, True): 40.0})).threads == 2
    assert choose(model, 1, 4, cache=cache, measure=again).threads == 4 and again.calls == []  # one node: all


def test_an_unreadable_cache_is_measured_anew(model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "core-share.json"
    cache.write_text("not json")
    rates = Rates({(1, False): 10.0, (2, True): 20.0})
    assert choose(model, 2, 2, cache=cache, measure=rates).threads == 2 and rates.calls


@pytest.mark.slow
@pytest.mark.parametrize("passive", [False, True])
def test_the_measuring_child_decodes_the_real_model(gemma_path: Path, passive: bool) -> None:
    rate = measure_in_child(gemma_path, 1, passive)
    assert 1.0 < rate < 10_000.0


def test_a_child_that_fails_says_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="measuring 1 threads failed"):
        measure_in_child(tmp_path / "missing.gguf", 1, False)
