"""The cut guard (``artifacts.arch_support``) on its own: the table covers the matrix, every refusal names the file,
the architecture, the setting and the layers, pins land in the shard, and nothing is downloaded for a refused range.
llama.cpp is not needed here: ``tests/test_arch_matrix.py`` proves what the table claims."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from artifacts import arch_support
from artifacts.arch_support import KNOWN_HAZARDS, SUPPORT, CutRequest, check_cut, proven_architectures
from artifacts.fetch import fetch_range
from artifacts.gguf_layout import KV, read_layout
from artifacts.manifest import build_manifest
from artifacts.shard import ShardSource, manifest_plan, write_shard
from artifacts.store import Store
from artifacts.synthetic import BUILDERS, Dims
from artifacts.synthetic.matrix import MATRIX, case
from artifacts.verify import verify_shard
from schemas.errors import BadRequestError
from tests.support.gguf_factory import write_unproven_gguf


def meta(arch: str, **values: Any) -> dict[str, Any]:
    return {f"{arch}.{k}": v for k, v in values.items()}


def request(arch: str, n_layers: int, start: int, end: int, *, n_vocab: int = 500, **values: Any) -> CutRequest:
    return CutRequest(arch, n_layers, n_vocab, meta(arch, block_count=n_layers, **values), start, end, where="m.gguf")


# --- the table --------------------------------------------------------------------------------------------------------


def test_the_table_is_the_matrix() -> None:
    proven_in_matrix = {c.arch for c in MATRIX if c.splits}
    assert set(proven_architectures()) == proven_in_matrix
    for arch in proven_in_matrix:
        main = case(arch)  # every proven architecture has its own case with the three splits
        assert set(main.splits) == {"2-way", "3-way", "unaligned"}
        assert len(main.splits["3-way"]) == 4 and main.unaligned
    refused = {a for a, s in SUPPORT.items() if s.status == "refused"}
    shown = {c.arch for c in MATRIX if c.why_refused and c.name == c.arch}
    assert shown <= refused
    assert refused - shown == {"gemma"}  # refused from the source alone: no tiny model (deepseek4 is proven now)
    assert set(BUILDERS) <= set(SUPPORT)
    for support in SUPPORT.values():
        assert support.families
        assert (support.status == "refused") == bool(support.reason)
    assert not set(KNOWN_HAZARDS) & set(SUPPORT)


def test_the_whole_range_is_never_a_cut() -> None:
    assert check_cut(request("olmo", 4, 0, 4)) == ()
    assert check_cut(request("glm4", 4, 0, 4)) == ()


# --- unproven and refused architectures -------------------------------------------------------------------------------


def test_an_unproven_architecture_is_refused_unless_the_user_accepts_the_risk() -> None:
    with pytest.raises(BadRequestError) as exc:
        check_cut(request("llama4", 48, 0, 24))
    msg = exc.value.message
    assert "m.gguf" in msg and "'llama4'" in msg and "[0, 24)" in msg and "not proven" in msg
    assert "use_kq_norm" in msg  # the known hazard is named
    assert all(arch in msg for arch in proven_architectures())
    assert check_cut(request("llama4", 48, 0, 24), allow_unproven=True) == ()


@pytest.mark.parametrize("arch", ["gemma2", "gemma", "glm4", "glm4moe"])
def test_a_refused_architecture_stays_refused_with_the_override(arch: str) -> None:
    with pytest.raises(BadRequestError, match=SUPPORT[arch].reason[:30].replace("(", r"\(")):
        check_cut(request(arch, 8, 0, 4), allow_unproven=True)


# --- layer-count rules ------------------------------------------------------------------------------------------------


def test_gemma3_with_62_layers_is_refused_only_when_the_scale_would_differ() -> None:
    like_27b = dict(embedding_length=5376, **{"attention.head_count": 32, "attention.key_length": 128})
    with pytest.raises(BadRequestError, match=r"f_attention_scale.*62-layer gemma3"):
        check_cut(request("gemma3", 62, 0, 31, **like_27b))
    # n_embd / n_head == head_dim: the 27B formula gives the same scale, the cut is exact.
    same = dict(embedding_length=4096, **{"attention.head_count": 32, "attention.key_length": 128})
    assert check_cut(request("gemma3", 62, 0, 31, **same)) == ()
    # A longer model whose shard has exactly 62 layers would be taken for the 27B: refused too.
    with pytest.raises(BadRequestError, match="62-layer shard"):
        check_cut(request("gemma3", 100, 0, 62, **like_27b))


def test_deepseek2_lite_shards_are_pinned_and_shards_that_would_turn_lite_are_refused() -> None:
    (pin,) = check_cut(request("deepseek2", 28, 0, 14, nextn_predict_layers=1))  # 27 trunk layers: lite
    assert (pin.key, pin.value) == ("deepseek2.attention.q_lora_rank", 0)
    full = dict(nextn_predict_layers=1, **{"attention.q_lora_rank": 1536})
    assert check_cut(request("deepseek2", 62, 0, 30, **full)) == ()
    with pytest.raises(BadRequestError, match=r"\[0, 27\).*n_lora_q.*27-layer deepseek2 shard counts as a 'lite'"):
        check_cut(request("deepseek2", 62, 0, 27, **full))


def test_deepseek2_gating_fallback_is_pinned() -> None:
    (pin,) = check_cut(request("deepseek2", 48, 0, 24, n_vocab=154880, nextn_predict_layers=1,
                               **{"attention.q_lora_rank": 32}))
    assert (pin.key, pin.value) == ("deepseek2.expert_gating_func", 2)
    explicit = check_cut(request("deepseek2", 48, 0, 24, n_vocab=154880, nextn_predict_layers=1,
                                 expert_gating_func=2, **{"attention.q_lora_rank": 32}))
    assert explicit == ()


def test_a_range_of_mtp_blocks_only_is_refused() -> None:
    with pytest.raises(BadRequestError, match=r"\[7, 8\).*MTP.*at or before layer 6"):
        check_cut(request("deepseek2", 8, 7, 8, nextn_predict_layers=1, **{"attention.q_lora_rank": 32}))
    assert check_cut(request("deepseek2", 8, 6, 8, nextn_predict_layers=1, **{"attention.q_lora_rank": 32})) == ()


def test_a_sliding_window_model_needs_a_sliding_layer_in_every_shard() -> None:
    window = {"attention.sliding_window": 512}
    with pytest.raises(BadRequestError, match=r"\[5, 6\).*no sliding layer"):
        check_cut(request("gemma3", 8, 5, 6, **window))
    assert check_cut(request("gemma3", 8, 5, 7, **window)) == ()
    assert check_cut(request("gemma3", 8, 5, 6)) == ()  # no window: llama.cpp builds a plain cache
    with pytest.raises(BadRequestError, match="no sliding layer"):
        check_cut(request("gpt-oss", 8, 3, 4))  # gpt-oss always slides


# --- through the shard writer and the fetch ---------------------------------------------------------------------------


def tiny(tmp_path: Path, arch: str, **dims: Any) -> Path:
    return BUILDERS[arch](Dims(**dims), f"t-{arch}").write(tmp_path / f"{arch}.gguf")


def test_write_shard_names_the_file_and_writes_the_pins(tmp_path: Path) -> None:
    src = tiny(tmp_path, "deepseek2", n_layers=28, n_nextn=1, q_lora_rank=0)
    out = write_shard(src, tmp_path / "s.gguf", 0, 14)
    assert read_layout(out).value("deepseek2.attention.q_lora_rank") == 0
    with pytest.raises(BadRequestError, match=str(tmp_path / "glm4.gguf")):
        write_shard(tiny(tmp_path, "glm4"), tmp_path / "g.gguf", 0, 3)
    assert not (tmp_path / "g.gguf").exists()


def test_an_unproven_architecture_is_cut_with_the_override(tmp_path: Path) -> None:
    src = write_unproven_gguf(tmp_path / "olmo.gguf")
    with pytest.raises(BadRequestError, match="'olmo' is not proven"):
        write_shard(src, tmp_path / "o.gguf", 1, 2)
    out = write_shard(src, tmp_path / "o.gguf", 1, 2, allow_unproven=True)
    assert read_layout(out).value("swarmroute.layer_start") == 1


def test_shards_of_an_architecture_that_requires_output_get_a_zero_one(tmp_path: Path) -> None:
    manifest = build_manifest(tiny(tmp_path, "gpt-oss", n_layers=4))
    head, middle, tail = (manifest_plan(manifest, a, b) for a, b in ((0, 1), (1, 3), (3, 4)))
    output = manifest.tensor("output.weight")
    assert [(t.name, t.shape) for t in head.synthetic] == [("output.weight", tuple(output.shape))]
    assert ("output.weight", (output.shape[0], 1)) in [(t.name, t.shape) for t in middle.synthetic]
    assert "output.weight" in tail.copied and not [t for t in tail.synthetic if t.name == "output.weight"]
    llama = build_manifest(tiny(tmp_path, "llama", n_layers=4))
    assert not [t for t in manifest_plan(llama, 0, 2).synthetic if t.name == "output.weight"]


def test_a_shard_cut_without_todays_rules_does_not_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard an older writer cut (no pin, or an architecture now refused) is never served."""
    lite = tiny(tmp_path, "deepseek2", n_layers=28, n_nextn=1, q_lora_rank=0)
    glm = tiny(tmp_path, "glm4", n_layers=4)
    manifests = {p: build_manifest(p) for p in (lite, glm)}

    def cut(path: Path, a: int, b: int) -> Path:
        source = ShardSource.from_gguf(path, manifest_id=manifests[path].manifest_id)
        return write_shard(source, tmp_path / f"{path.stem}-{a}-{b}.gguf", a, b, allow_unproven=True)

    assert verify_shard(manifests[lite], cut(lite, 0, 14), 0, 14).ok
    with monkeypatch.context() as m:
        # A copy of the table, not the shared one edited: restoring a deleted key would reorder the table, whose
        # order docs/models/architectures.md follows.
        table = {k: v for k, v in SUPPORT.items() if k != "glm4"}
        table["deepseek2"] = dataclasses.replace(SUPPORT["deepseek2"], rules=())
        m.setattr(arch_support, "SUPPORT", table)
        stale, refused = cut(lite, 0, 14), cut(glm, 2, 4)
    problems = verify_shard(manifests[lite], stale, 0, 14).problems
    assert [(p.kind, p.what) for p in problems] == [("metadata", "deepseek2.attention.q_lora_rank")]
    (problem,) = verify_shard(manifests[glm], refused, 2, 4).problems
    assert problem.kind == "metadata" and "GGML_ABORT" in problem.detail


class _NoSession:
    """A torrent session that must not be touched: a refused range is refused before any download."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the fetch used the torrent session ({name}) for a refused range")


def test_the_fetch_refuses_before_downloading(tmp_path: Path) -> None:
    manifest = build_manifest(tiny(tmp_path, "glm4", n_layers=4))
    store = Store(tmp_path / "home")
    with pytest.raises(BadRequestError, match="glm4"):
        fetch_range(store, manifest, 2, 4, session=_NoSession(), peers=list)  # type: ignore[arg-type]
    assert not store.model_dir(manifest.model_id).exists()
    source = ShardSource.from_manifest(manifest, tmp_path / "absent.gguf")
    assert source.n_vocab == manifest.n_vocab > 0


def test_deepseek4_keeps_its_hash_layers_on_the_head_and_a_csa_layer_on_every_shard() -> None:
    meta = {"deepseek4.hash_layer_count": 3, "deepseek4.attention.compress_ratios": [0, 0, 4, 128, 4, 128, 4]}

    def cut(a: int, b: int) -> tuple[KV, ...]:
        return check_cut(CutRequest("deepseek4", 7, 100, meta, a, b, where="v4.gguf"))

    assert [(kv.key, kv.value) for kv in cut(0, 3)] == [("deepseek4.hash_layer_count", 3)]
    assert [(kv.key, kv.value) for kv in cut(3, 7)] == [("deepseek4.hash_layer_count", 0)]
    for a, b, says in ((0, 2, "layers 2..2 would go to a shard fed hidden states"),
                       (1, 7, "this shard would take layers 1..2 of them"),
                       (3, 4, "layers 3..3 hold no CSA (compress ratio 4) layer")):
        with pytest.raises(BadRequestError, match=re.escape(says)) as refused:
            cut(a, b)
        assert "v4.gguf" in refused.value.message and f"[{a}, {b})" in refused.value.message


@pytest.mark.parametrize(("arch", "why"), [("qwen35moe", "M-RoPE"), ("glm-dsa", "indexer.types")])
def test_recurrent_and_dsa_models_are_refused_with_what_their_tiny_model_showed(arch: str, why: str) -> None:
    """Both build and run whole (tests/test_arch_matrix.py); every cut is refused, even with the unproven override,
    with the failure the tiny model showed."""
    n = case(arch).n_layers
    for a, b in ((0, n // 2), (n // 2, n)):
        with pytest.raises(BadRequestError, match=why) as exc:
            check_cut(request(arch, n, a, b), allow_unproven=True)
        assert "tiny model" in exc.value.message and f"[{a}, {b})" in exc.value.message
    assert check_cut(request(arch, n, 0, n)) == ()  # served whole on one node
