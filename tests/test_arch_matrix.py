"""The architecture matrix: every proven architecture routes bit-exactly across shards; every refused one is refused,
and a tiny model shows why.

For each case of ``artifacts.synthetic.matrix`` (a tiny seeded GGUF per architecture, F16 and Q8_0):
* backend chains: 2-way, 3-way and an unaligned split equal the whole GGUF in llama.cpp (tail logits max abs diff
  0.0, same greedy tokens) after a prompt longer than any sliding window;
* routes: every split of every case (2-way, 3-way, unaligned, and the variants' splits) through real nodes, tracker,
  gateway and nats-server gives the same;
* KV: each hop's cache grows by exactly its layers' share, and the planner's estimate matches llama.cpp;
* the guard refuses what must not be cut (a lone global layer, a lone MTP block, gemma3 with 62 layers where the 27B
  scale differs, gemma2, glm4, glm4moe) and allows the 62-layer gemma3 whose scale does not differ (proven
  bit-exact above), and the refusal is earned: with the guard lifted, gemma3-62 and gemma2 chains compute other logits,
  glm4/glm4moe shards abort llama.cpp, a qwen35moe chain computes other logits (M-RoPE positions of embedding
  batches), a glm-dsa shard does not load (its per-trunk-layer indexer types), and deepseek2 shards without their pins
  compute other logits or fail to load;
* ``docs/models/architectures.md`` is the table rendered from these results (``SWARMROUTE_WRITE_DOCS=1`` rewrites it).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from gguf import GGUFReader

llama_cpp = pytest.importorskip("llama_cpp")  # a skip fails under CI=true (tests/support/ci_strict.py)

from artifacts import arch_support  # noqa: E402
from artifacts.arch_support import SUPPORT  # noqa: E402
from artifacts.gguf_shape import shape_from_gguf  # noqa: E402
from artifacts.shard import write_shard  # noqa: E402
from artifacts.synthetic.matrix import MATRIX, MatrixCase, case, ranges  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from schemas.errors import BadRequestError, ModelLoadError  # noqa: E402
from tests.support import arch_doc  # noqa: E402
from tests.support.arch_matrix import (  # noqa: E402
    RouteHarness,
    Run,
    build,
    greedy,
    kv_growth,
    open_backend,
    open_chain,
    prompt_tokens,
)

pytestmark = pytest.mark.slow

PROVEN = [(c, q) for c in MATRIX if c.splits for q in c.quants]
CHAINS = [pytest.param(c, q, s, id=f"{c.name}-{q}-{s}") for c, q in PROVEN for s in c.splits]
ROUTES = CHAINS  # every chain again, through the real node and route code
REFUSED = [pytest.param(c, s, id=f"{c.name}-{s}") for c in MATRIX for s in c.refused_splits]

RESULTS = arch_doc.Results()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("matrix")


_reference: dict[tuple[str, str], tuple[list[int], Run]] = {}


def reference(c: MatrixCase, quant: str, models: Path) -> tuple[list[int], Run]:
    """The case's prompt tokens and the whole GGUF's greedy run (computed once per module)."""
    key = (c.name, quant)
    if key not in _reference:
        whole = open_backend(build(c, quant, models), models / "shards")
        try:
            tokens = prompt_tokens(whole)
            _reference[key] = (tokens, greedy([whole], tokens))
        finally:
            whole.close()
    return _reference[key]


def shard_dir(models: Path, c: MatrixCase, quant: str) -> Path:
    return models / f"{c.name}-{quant}.shards"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def harness(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RouteHarness]:
    h = await RouteHarness.start(module_nats, tmp_path_factory.mktemp("home"))
    yield h
    await h.stop()


# --- proven: bit-exact ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("c", "quant", "split"), CHAINS)
def test_chain_equals_the_whole_model(c: MatrixCase, quant: str, split: str, models: Path) -> None:
    tokens, whole = reference(c, quant, models)
    assert len(tokens) > c.dims.sliding_window  # past the window: sliding and global layers differ
    hops = open_chain(build(c, quant, models), shard_dir(models, c, quant), c.splits[split])
    try:
        chain = greedy(hops, tokens)
        shape = hops[0].info.hidden_shape
        hop_shape = f"(n_embd,) {hops[0].info.wire_dtype}" if shape == [c.dims.n_embd] else f"{tuple(shape)}"
    finally:
        for h in hops:
            h.close()
    RESULTS.record_chain(c.name, quant, split, whole.max_diff(chain), chain.picks == whole.picks, hop_shape)
    assert chain.picks == whole.picks
    assert whole.max_diff(chain) == 0.0


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("c", "quant", "split"), ROUTES)
async def test_route_through_real_nodes_equals_the_whole_model(c: MatrixCase, quant: str, split: str, models: Path,
                                                               harness: RouteHarness) -> None:
    tokens, whole = reference(c, quant, models)
    hops = open_chain(build(c, quant, models), shard_dir(models, c, quant), c.splits[split])
    try:
        got, route = await harness.route(hops, tokens)
    finally:
        for h in hops:
            h.close()
    RESULTS.record_route(c.name, quant, split, whole.max_diff(got), got.picks == whole.picks)
    assert len(route) == len(hops) and len(set(route)) == len(hops)
    assert got.picks == whole.picks
    assert whole.max_diff(got) == 0.0


@pytest.mark.parametrize("c", [c for c in MATRIX if c.splits and c.arch == c.name], ids=lambda c: c.name)
def test_each_hop_holds_only_its_layers_kv(c: MatrixCase, models: Path) -> None:
    path = build(c, "F16", models)
    tokens, _ = reference(c, "F16", models)
    whole = open_backend(path, shard_dir(models, c, "F16"))
    try:
        (grown,) = kv_growth([whole], tokens)
    finally:
        whole.close()
    hops = open_chain(path, shard_dir(models, c, "F16"), c.splits["3-way"])
    try:
        per_hop = kv_growth(hops, tokens)
    finally:
        for h in hops:
            h.close()
    # Besides K/V rows, llama.cpp's sequence state stores 12 bytes of bookkeeping per position and cache (two
    # caches when sliding and global layers are kept apart).
    caches = 2 if any(layer.kind == "sliding" for layer in shape_from_gguf(path).layers) else 1
    bookkeeping = 12 * caches
    data = grown - bookkeeping
    shape = shape_from_gguf(path)
    if c.arch not in arch_doc.KV_BLOCKWISE:
        assert data == shape.kv_bytes(0, shape.n_layers, 8, 2.0) / 8  # the planner's estimate is llama.cpp's size
    assert sum(g - bookkeeping for g in per_hop) == data
    RESULTS.record_kv(c.name, int(data), [int(g - bookkeeping) for g in per_hop])


# --- refused: the guard, and why --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("c", "split"), REFUSED)
def test_the_guard_refuses(c: MatrixCase, split: str, models: Path) -> None:
    quant = c.quants[0]
    path = build(c, quant, models)
    refused = []
    for a, b in ranges(c.refused_splits[split]):
        try:
            open_backend(path, shard_dir(models, c, quant), a, b).close()
        except BadRequestError as exc:
            assert c.arch in exc.message and f"[{a}, {b})" in exc.message and str(path) in exc.message
            refused.append((a, b, exc.message))
    assert refused, f"no range of {c.refused_splits[split]} was refused"
    RESULTS.record_refusal(c.name, split, refused[0][2])


@pytest.fixture
def guard_lifted(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty architecture table (no refusals, no layer-count rules): cuts then need the unproven override. A new
    dict, not the shared one emptied: restoring deleted keys would reorder it, and the document renders its order."""
    monkeypatch.setattr(arch_support, "SUPPORT", {})


@pytest.mark.parametrize("name", [c.name for c in MATRIX if c.why_refused == "scale"])
def test_without_the_guard_the_chain_is_silently_wrong(name: str, models: Path, guard_lifted: None) -> None:
    c = case(name)
    tokens, whole = reference(c, "F16", models)
    hops = open_chain(build(c, "F16", models), models / f"{name}-unguarded", c.refused_splits["2-way"],
                      allow_unproven=True)
    try:
        chain = greedy(hops, tokens)
    finally:
        for h in hops:
            h.close()
    diff = whole.max_diff(chain)
    RESULTS.record_unguarded(name, diff)
    assert diff > 0.01  # loads and runs, computes something else


@pytest.mark.parametrize("name", [c.name for c in MATRIX if c.why_refused == "abort"])
def test_without_the_guard_a_shard_after_the_head_aborts(name: str, models: Path, guard_lifted: None) -> None:
    c = case(name)
    path = build(c, "F16", models)
    tokens, whole = reference(c, "F16", models)  # the whole model runs fine
    assert len(whole.picks) > 0
    a, b = ranges(c.refused_splits["2-way"])[1]
    shard = write_shard(path, models / f"{name}-unguarded-{a}-{b}.gguf", a, b, allow_unproven=True)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "tests.support.embd_probe", str(shard)], capture_output=True,
                         text=True, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode < 0, out.stdout + out.stderr  # killed by a signal (SIGABRT), not a Python error
    assert "survived" not in out.stdout
    assert "does not support multimodal" in out.stderr
    RESULTS.record_unguarded(name, None)


@pytest.mark.parametrize("name", [c.name for c in MATRIX if c.why_refused == "load"])
def test_without_the_guard_a_shard_does_not_load(name: str, models: Path, guard_lifted: None) -> None:
    """glm-dsa: ``attention.indexer.types`` has one entry per trunk layer, not per block, so the shard writer copies
    it whole and llama.cpp refuses the shard's array length."""
    c = case(name)
    path = build(c, "F16", models)
    tokens, whole = reference(c, "F16", models)  # the whole model runs fine
    assert len(whole.picks) > 0
    a, b = ranges(c.refused_splits["2-way"])[0]
    shard = write_shard(path, models / f"{name}-unguarded-{a}-{b}.gguf", a, b, allow_unproven=True)
    key = f"{c.arch}.attention.indexer.types"
    assert len(GGUFReader(path).fields[key].data) == c.dims.n_trunk  # per trunk layer in the whole model
    assert len(GGUFReader(shard).fields[key].data) == c.dims.n_trunk != b - a  # copied whole into the shard
    with pytest.raises(ModelLoadError):
        open_backend(path, models / f"{name}-unguarded", a, b, allow_unproven=True).close()
    RESULTS.record_unguarded(name, None)


def test_pins_are_needed(models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its pins a deepseek2-gating shard computes other logits and a deepseek2-lite shard does not load."""
    gating, lite = case("deepseek2-gating"), case("deepseek2-lite")
    monkeypatch.setitem(SUPPORT, "deepseek2", dataclasses.replace(SUPPORT["deepseek2"], rules=()))
    tokens, whole = reference(gating, "F16", models)
    hops = open_chain(build(gating, "F16", models), models / "gating-unpinned", gating.splits["2-way"])
    try:
        diff = whole.max_diff(greedy(hops, tokens))
    finally:
        for h in hops:
            h.close()
    assert diff > 0.01
    with pytest.raises(ModelLoadError):
        open_backend(build(lite, "F16", models), models / "lite-unpinned", 14, 28).close()


# --- the document -----------------------------------------------------------------------------------------------------


def test_architectures_doc_matches_the_matrix() -> None:
    """Last in the module: renders the table from the results the tests above recorded in this run."""
    expected = arch_doc.render(RESULTS)
    doc = Path(__file__).resolve().parents[1] / "docs" / "models" / "architectures.md"
    if os.environ.get("SWARMROUTE_WRITE_DOCS") == "1":
        doc.write_text(expected)
    assert doc.read_text() == expected, "docs/models/architectures.md is stale: rerun with SWARMROUTE_WRITE_DOCS=1"
