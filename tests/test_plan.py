"""``swarmroute plan``: layer splits checked against numbers computed here, independently of the planner.

Gemma: the real bundled GGUF, read a second time with gguf-py's own ``GGUFReader`` (a different parser from the
planner's) for tensor bytes and attention metadata. DeepSeek-V4-Flash / GLM-5.2 / Ornith: the shipped shape files,
checked against parameter and cache formulas written from the public configs (see docs/models/).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from artifacts.gguf_shape import glm52_indexer_types, shape_from_gguf
from artifacts.layer_split import NodeSpec, Plan, PlanSettings, parse_nodes, parse_tokens, split
from artifacts.model_shape import ModelShape
from artifacts.shape_file import load_shape_file
from bus.frame import encode, session_bytes
from schemas.errors import BadRequestError, NoRouteError
from schemas.frame import FrameHeader, FrameKind, HopStamp, WireDType
from swarmroute.cli import main as cli_main
from swarmroute.plan_command import register


def main(argv: list[str]) -> int:
    return cli_main(["plan", *argv])


DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "models"
GIB = 2**30


def frame_len(position_shape: Sequence[int], hop_index: int, dtype: WireDType = WireDType.F32) -> int:
    """Bytes of a real one-position decode frame leaving hop ``hop_index`` (one stamp per hop so far)."""
    header = FrameHeader(session_id=session_bytes(uuid.uuid4().hex), kind=FrameKind.DECODE, dtype=dtype,
                         start_position=7, n_positions=1, position_shape=tuple(position_shape), step=1, sample=True,
                         stamps=tuple(HopStamp(i, 10, 1) for i in range(hop_index + 1)))
    return len(encode(header, np.zeros((1, *position_shape), dtype=np.float32)))


def nodes(*gib: float) -> list[NodeSpec]:
    return [NodeSpec(f"{g}GiB", int(g * GIB)) for g in gib]


def check_fits(plan: Plan) -> None:
    for a in plan.assignments:
        assert a.total_bytes <= a.usable_bytes, f"{a.node.label} holds {a.total_bytes} > {a.usable_bytes}"
    covered = [i for a in plan.assignments for i in range(a.start, a.end)]
    assert covered == list(range(plan.shape.n_layers))


# --- Gemma 3 270M, the real GGUF -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_ref(gemma_path: Path) -> dict[str, object]:
    from gguf import GGUFReader

    reader = GGUFReader(str(gemma_path))

    def value(key: str) -> int:
        return int(reader.fields[key].contents())

    layer_bytes: dict[int, int] = {}
    other: dict[str, int] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            il = int(t.name.split(".")[1])
            layer_bytes[il] = layer_bytes.get(il, 0) + int(t.n_bytes)
        else:
            other[t.name] = int(t.n_bytes)
    n_layers = value("gemma3.block_count")
    return {"layers": [layer_bytes[i] for i in range(n_layers)], "other": other, "n_layers": n_layers,
            "n_kv": value("gemma3.attention.head_count_kv"), "head_dim": value("gemma3.attention.key_length"),
            "window": value("gemma3.attention.sliding_window"), "hidden": value("gemma3.embedding_length")}


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> ModelShape:
    return shape_from_gguf(gemma_path)


def gemma_kv(ref: dict[str, object], start: int, end: int, context: int, itemsize: int = 2) -> int:
    """2 * n_kv * head_dim * bytes per position; sliding layers keep ``window`` positions, every 6th layer all."""
    n_kv, hd, window = int(ref["n_kv"]), int(ref["head_dim"]), int(ref["window"])  # type: ignore[call-overload]
    return sum(2 * n_kv * hd * itemsize * (context if il % 6 == 5 else min(context, window))
               for il in range(start, end))


@pytest.mark.slow
def test_gemma_split_bytes_match_the_gguf(gemma: ModelShape, gemma_ref: dict[str, object]) -> None:
    settings = PlanSettings(context=32768)
    plan = split(gemma, nodes(0.4, 0.4, 0.4), settings)
    check_fits(plan)
    assert plan.cuts == (6, 12), "three equal nodes cut after the global layers 5 and 11"
    assert not plan.warnings
    layers: list[int] = gemma_ref["layers"]  # type: ignore[assignment]
    other: dict[str, int] = gemma_ref["other"]  # type: ignore[assignment]
    assert "output.weight" not in other, "the bundled Gemma ties its lm_head to token_embd"
    embd, norm = other["token_embd.weight"], other["output_norm.weight"]
    head, middle, tail = plan.assignments
    assert head.weight_bytes == sum(layers[0:6]) + embd
    assert middle.weight_bytes == sum(layers[6:12])
    assert tail.weight_bytes == sum(layers[12:18]) + norm + embd  # tied: the tail needs the embedding as lm_head
    for a in plan.assignments:
        assert a.kv_bytes == gemma_kv(gemma_ref, a.start, a.end, 32768)
        n_kv, hd = int(gemma_ref["n_kv"]), int(gemma_ref["head_dim"])  # type: ignore[call-overload]
        assert a.kv_bytes_per_token == 2 * n_kv * hd * 2 * sum(1 for il in range(a.start, a.end) if il % 6 == 5)


@pytest.mark.slow
def test_gemma_single_node_counts_the_tied_embedding_once(gemma: ModelShape, gemma_ref: dict[str, object],
                                                          gemma_path: Path) -> None:
    plan = split(gemma, nodes(2.0), PlanSettings(context=131072, kv_itemsize=4.0))
    (only,) = plan.assignments
    assert only.roles == ("head", "tail")
    other: dict[str, int] = gemma_ref["other"]  # type: ignore[assignment]
    assert only.weight_bytes == sum(gemma_ref["layers"]) + sum(other.values())  # type: ignore[arg-type]
    # every tensor byte of the file is in the plan, nothing else: file = header + tensors (+ alignment padding)
    assert gemma_path.stat().st_size - only.weight_bytes < 8 * 2**20
    assert only.kv_bytes == gemma_kv(gemma_ref, 0, 18, 131072, itemsize=4)
    assert plan.hop_bytes == ()


@pytest.mark.slow
def test_gemma_hop_bytes_are_real_frame_sizes(gemma: ModelShape, gemma_ref: dict[str, object]) -> None:
    for dtype in (WireDType.F32, WireDType.F16):
        plan = split(gemma, nodes(0.4, 0.4, 0.4), PlanSettings(context=32768, wire_dtype=dtype))
        hidden = int(gemma_ref["hidden"])  # type: ignore[call-overload]
        assert plan.hop_bytes == (frame_len([hidden], 0, dtype), frame_len([hidden], 1, dtype))


@pytest.mark.slow
def test_gemma_misaligned_cut_is_warned(gemma: ModelShape) -> None:
    # Node a holds [0, 9) but not [0, 12); node b holds [9, 18) but not [6, 18): only a cut inside [6, 12) fits.
    context, margin = 4096, 2**20
    a = gemma.head_bytes + gemma.shared_bytes + gemma.weight_bytes(0, 9) + gemma.kv_bytes(0, 9, context, 2) + margin
    b = (gemma.tail_bytes + gemma.head_bytes + gemma.shared_bytes + gemma.weight_bytes(9, 18)
         + gemma.kv_bytes(9, 18, context, 2) + margin)
    plan = split(gemma, [NodeSpec("a", a), NodeSpec("b", b)], PlanSettings(context=context, reserve=0.0))
    check_fits(plan)
    assert plan.cuts == (9,)
    assert any("sliding_window_pattern" in w and "layer 9" in w for w in plan.warnings)


@pytest.mark.slow
def test_gemma_too_small_is_a_clear_error(gemma: ModelShape) -> None:
    with pytest.raises(NoRouteError) as err:
        split(gemma, nodes(0.05, 0.05), PlanSettings(context=32768))
    assert err.value.status == 503 and err.value.code == "plan_does_not_fit"
    assert "does not fit" in err.value.message and "GiB" in err.value.message


@pytest.mark.slow
def test_cli_prints_the_split_and_json(gemma_path: Path, gemma_ref: dict[str, object]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(gemma_path), "--nodes", "3x400MB", "--context", "32K"]) == 0
    text = out.getvalue()
    assert "[0, 6)" in text and "[12, 18)" in text and "decode hop bytes" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(gemma_path), "--node", "400MB", "--node", "400MB", "--context", "32K", "--json"]) == 0
    doc = json.loads(out.getvalue())
    assert [n["layers"][0] for n in doc["nodes"]][0] == 0 and doc["nodes"][-1]["layers"][1] == 18
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([str(gemma_path), "--nodes", "2x10MB"]) == 2
    assert err.getvalue().startswith("error:")


def test_register_adds_the_plan_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="swarmroute")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "m.gguf", "--nodes", "4x24GB", "--node", "80GB", "--context", "1M"])
    assert args.command == "plan" and callable(args.func)
    assert [len(group) for group in args.nodes] == [4] and args.nodes[0][0].memory_bytes == 24 * GIB
    assert args.node[0][0].memory_bytes == 80 * GIB and args.context == parse_tokens("1M") == 2**20


def test_node_and_context_parsing() -> None:
    parsed = parse_nodes(["4x24GB", "80GiB,512MiB"])
    assert [n.memory_bytes for n in parsed] == [24 * GIB] * 4 + [80 * GIB, 512 * 2**20]
    assert parse_tokens("128K") == 131072 and parse_tokens("4096") == 4096
    for bad in ("24 parsecs", "0x24GB", ""):
        with pytest.raises(BadRequestError):
            parse_nodes([bad])
    with pytest.raises(BadRequestError):
        parse_tokens("lots")


# --- DeepSeek-V4-Flash (synthetic shape from the public config) --------------------------------------------------

# deepseek-ai/DeepSeek-V4-Flash config (as in transformers 5.24 DeepseekV4Config and antirez/ds4 ds4.c)
H, V, NH, HD, QL, OG, OL = 4096, 129280, 64, 512, 1024, 8, 1024
E, FF, HC, IH, ID, SWA, HASH = 256, 2048, 4, 64, 128, 128, 3
RATIOS = [0, 0] + [4, 128] * 20 + [4]


def dsv4_params(il: int) -> tuple[int, int, int]:
    """(matrix params, f32 vector params, int32 params) of layer ``il`` from the config alone."""
    ratio = RATIOS[il]
    mats = H * QL + QL * NH * HD + H * HD + (HD * NH // OG) * (OG * OL) + OG * OL * H  # attention
    mats += 2 * HC * H * (2 + HC) * HC + H * E  # two mHC mixers, router
    mats += 3 * E * H * FF + 3 * H * FF  # routed + shared experts
    vecs = H + NH + QL + HD + 2 * (3 + (2 + HC) * HC) + H + (0 if il < HASH else E)
    if ratio:
        coff = 2 if ratio == 4 else 1
        mats += 2 * H * coff * HD + coff * HD * ratio
        vecs += HD
    if ratio == 4:
        mats += QL * IH * ID + H * IH + 2 * H * 2 * ID + 2 * ID * ratio
        vecs += ID
    return mats, vecs, (6 * V if il < HASH else 0)


@pytest.fixture(scope="module")
def dsv4() -> ModelShape:
    return load_shape_file(DEPLOY / "deepseek-v4-flash.toml", "bf16")


def test_dsv4_layer_bytes_follow_the_config(dsv4: ModelShape) -> None:
    assert dsv4.n_layers == len(RATIOS) and dsv4.hop_shape == (HC, H)
    for layer in dsv4.layers:
        mats, vecs, ints = dsv4_params(layer.index)
        assert layer.weight_bytes == 2 * mats + 4 * vecs + 4 * ints, f"layer {layer.index}"
    total = sum(sum(dsv4_params(il)) for il in range(len(RATIOS))) + 2 * H * V
    assert abs(total - 284e9) / 284e9 < 0.01, "the model card's 284B total parameters"
    active = sum(H * QL + QL * NH * HD + H * HD + 2 * OG * OL * H + 7 * 3 * H * FF for _ in RATIOS) + 2 * H * V
    assert abs(active - 13e9) / 13e9 < 0.05, "the model card's 13B activated parameters"


def dsv4_kv(il: int, context: int, itemsize: float = 2) -> float:
    ratio = RATIOS[il]
    raw = min(context, SWA) * HD
    if not ratio:
        return raw * itemsize
    coff = 2 if ratio == 4 else 1
    comp = math.ceil(context / ratio) * (HD + (ID if ratio == 4 else 0))
    state = 2 * coff * HD * coff * ratio + (2 * coff * ID * coff * ratio if ratio == 4 else 0)
    return (raw + comp) * itemsize + 4 * state


def test_dsv4_cache_and_hop(dsv4: ModelShape) -> None:
    context = 131072
    plan = split(dsv4, nodes(400, 400), PlanSettings(context=context))
    check_fits(plan)
    per_token = sum(a.kv_bytes_per_token for a in plan.assignments)
    assert per_token == sum((HD + ID) / 4 * 2 if r == 4 else HD / 128 * 2 if r else 0 for r in RATIOS)
    tail = plan.assignments[-1]
    mtp_raw = min(context, SWA) * HD * 2
    assert tail.kv_bytes == sum(dsv4_kv(il, context) for il in range(tail.start, tail.end)) + mtp_raw
    assert plan.hop_bytes == (frame_len([HC, H], 0),)
    mtp = dsv4.mtp_layers[0].weight_bytes
    assert tail.weight_bytes == dsv4.weight_bytes(tail.start, tail.end) + dsv4.tail_bytes + mtp + dsv4.head_bytes


def test_dsv4_hash_layers_stay_on_the_head() -> None:
    shape = load_shape_file(DEPLOY / "deepseek-v4-flash.toml", "ds4-q2")
    two_layers = shape.head_bytes + shape.weight_bytes(0, 2) + 2 * 2**20
    assert two_layers < shape.head_bytes + shape.weight_bytes(0, 3)
    plan = split(shape, [NodeSpec("small", two_layers), *nodes(100, 100)],
                 PlanSettings(context=4096, reserve=0.0, balance=False))
    check_fits(plan)
    assert plan.unused and plan.unused[0].label == "small", "a head that fits only layers 0-1 is left out"
    assert plan.assignments[0].end >= 3
    for head_gib in range(8, 40, 2):
        plan = split(shape, nodes(head_gib, 80, 80), PlanSettings())
        assert not {1, 2} & set(plan.cuts)
    with pytest.raises(NoRouteError):
        split(load_shape_file(DEPLOY / "deepseek-v4-flash.toml", "fp4-fp8"), nodes(80, 80), PlanSettings())


def test_dsv4_published_sizes() -> None:
    # antirez/ds4 gguf-tools/README.md: "roughly 80-90 GB" for the 2-bit recipe, "150-170 GB" for the 4-bit one
    # (main GGUF, MTP shipped separately).
    for quant, lo, hi in (("ds4-q2", 80e9, 90e9), ("ds4-q4", 150e9, 170e9)):
        shape = load_shape_file(DEPLOY / "deepseek-v4-flash.toml", quant)
        main_gguf = shape.total_weight_bytes() - sum(m.weight_bytes for m in shape.mtp_layers)
        assert lo <= main_gguf <= hi, (quant, main_gguf)


# --- GLM-5.2 ---------------------------------------------------------------------------------------------------


def test_glm52_never_cuts_an_indexshare_group() -> None:
    shape = load_shape_file(DEPLOY / "glm-5.2.toml")
    full = glm52_indexer_types(78)
    assert sum(full) == 21
    allowed = {c for c in range(1, 79) if c == 78 or full[c] or c < 3}
    for n in (18, 20, 24):
        plan = split(shape, nodes(*[80] * n), PlanSettings())
        check_fits(plan)
        assert set(plan.cuts) <= allowed, plan.cuts
        assert all(b == frame_len([6144], i) for i, b in enumerate(plan.hop_bytes))
    per_token = split(shape, nodes(2000), PlanSettings()).assignments[0].kv_bytes_per_token
    assert per_token == (78 * 576 + 21 * 128 + 576) * 2  # MLA latent everywhere, indexer keys on full layers, MTP
    carried = split(shape, nodes(*[80] * 12), PlanSettings(split_groups=True))
    check_fits(carried)
    inside = [i for i, c in enumerate(carried.cuts) if c not in allowed]
    assert inside and all(carried.hop_bytes[i] == frame_len([6144], i) + 2048 * 4 for i in inside)


def test_glm52_parameter_count() -> None:
    shape = load_shape_file(DEPLOY / "glm-5.2.toml", "bf16")
    # llama.cpp names the 78-layer glm-dsa model 744B_A40B; bf16 is ~2 bytes per parameter
    trunk = shape.total_weight_bytes() - sum(m.weight_bytes for m in shape.mtp_layers)
    assert abs(trunk / 2 - 744e9) / 744e9 < 0.01


# --- Ornith-1.5-35B-A3B ------------------------------------------------------------------------------------------


def test_ornith_recurrent_state_is_fixed_per_session() -> None:
    shape = load_shape_file(DEPLOY / "ornith-1.5-35b-a3b.toml")
    state = 3 * (2 * 16 * 128 + 32 * 128) + 128 * 32 * 128  # (conv-1)(2 key_dim + value_dim) + d_state d_inner
    one = split(shape, nodes(48), PlanSettings(context=4096))
    two = split(shape, nodes(48), PlanSettings(context=8192))
    grow = two.assignments[0].kv_bytes - one.assignments[0].kv_bytes
    assert grow == (10 + 1) * 2 * 2 * 256 * 2 * 4096  # only the 10 full-attention layers (+ MTP) grow
    assert one.assignments[0].kv_bytes == 30 * state * 4 + (10 + 1) * 2 * 2 * 256 * 2 * 4096
    # the first-party Q4_K_M GGUF is 21.71 GB (ornith-ai/Ornith-1.5-35B-A3B-GGUF); the file's q4_k is an estimate
    assert abs(shape.total_weight_bytes() - 21.71e9) / 21.71e9 < 0.05


@pytest.mark.parametrize("memory_mib", [512, 1024, 4096])
def test_a_nodes_sessions_are_what_its_memory_holds_beside_its_layers(gemma: ModelShape, memory_mib: int) -> None:
    """Issue #30: a node's session count from its memory is the planner's own arithmetic: ``held`` sessions fit the
    node's memory for the whole model at the context, one more does not."""
    from artifacts.layer_split import sessions_held

    memory, settings = memory_mib * 2**20, PlanSettings(context=4096)
    held = sessions_held(gemma, 0, gemma.n_layers, memory, settings)
    assert held >= 1
    plan = split(gemma, [NodeSpec("a", memory)], dataclasses.replace(settings, sessions=held))
    assert plan.assignments[0].total_bytes <= memory
    with pytest.raises(NoRouteError):
        split(gemma, [NodeSpec("a", memory)], dataclasses.replace(settings, sessions=held + 1))
    assert sessions_held(gemma, 0, gemma.n_layers, 2**20, settings) == 0  # not even the weights fit
