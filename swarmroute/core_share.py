"""How ``swarmroute up``'s local llama.cpp nodes share this machine's cores, measured on this CPU (issue #26 item 4).

Nodes on one machine either split the cores (each an equal share, libgomp's spinning wait: ``local_threads``) or
each take every core with OpenMP's passive wait (``local_node_env`` sets it where the threads outnumber the cores),
so that the one node computing a lone session's step has them all while the idle one's threads sleep. Which is
faster depends on the CPU, and by a lot: on a 2-core Intel Xeon the share decoded 27.0 tok/s and every core with
the passive wait 25.5; on a 2-core AMD EPYC 25.9 and 35.9 (and 35.8 against 53.6 with 4 concurrent streams;
docs/operations.md "Cores on one machine"). A single llama.cpp process predicts it on both: one thread with the
spinning wait against every core with the passive wait (28.8 against 24.4 on the Xeon, 27.2 against 37.1 on the
EPYC), since the idle node of a route costs little either way. So ``up`` measures those two on the model it serves,
each in a process of its own (OpenMP reads its wait policy once, at start), rounds interleaved, and keeps every
core only for a clear win (``MARGIN``). The result is cached per CPU, core count, model file and llama.cpp version
(``Settings.core_share_cache``), so only a machine's first ``up`` of a model pays the few seconds.

Not measured, the equal share: an explicit ``--threads``, an operator's own OpenMP wait setting, one node, a model
larger than ``MAX_MODEL_BYTES`` (its load alone would take longer than the gain is worth at start) or
``SWARMROUTE_UP_MEASURE_CORES=0``. ``python -m swarmroute.core_share MODEL THREADS`` is the measuring child: it
prints one decode rate in tokens per second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MARGIN = 1.10
"""Every core per node must decode this much faster than the share to be chosen: the share is the steadier default
(measured among the steadiest on the Xeon) and two close figures are noise."""
MAX_MODEL_BYTES = 4 << 30
ROUNDS = 2
WARM_TOKENS = 8
TIMED_TOKENS = 24
OPENMP_WAIT = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

def operator_chose_wait() -> bool:
    """The environment sets OpenMP's wait (either variable): the operator's choice wins over any measurement."""
    return any(name in os.environ for name in OPENMP_WAIT)


Measure = Callable[[Path, int, bool], float]
"""(model, threads, passive wait) -> decode tokens per second."""


@dataclasses.dataclass(frozen=True)
class CoreShare:
    """Threads per node ``up`` gives its nodes, and why (``up`` prints it)."""

    threads: int
    why: str


def measure_in_child(model: Path, threads: int, passive: bool) -> float:
    """One decode rate of ``model`` with ``threads`` threads, in a child process with that OpenMP wait."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT}
    if passive:
        env["OMP_WAIT_POLICY"] = "passive"
    done = subprocess.run([sys.executable, "-m", "swarmroute.core_share", str(model), str(threads)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {threads} threads failed: {done.stderr.strip()[-500:]}")
    return float(done.stdout.strip().splitlines()[-1])


def cache_key(model: Path, cores: int, n_local: int) -> str:
    stat = model.stat()
    try:  # the distribution's metadata: importing llama_cpp would load libllama into the launcher for a string
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    text = f"{cpu_model()}|{cores}|{n_local}|{model.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def choose(model: Path, n_local: int, cores: int, *, cache: Path, measure: Measure = measure_in_child) -> CoreShare:
    """The threads of each of ``n_local`` nodes sharing ``cores`` cores, measured (or read from ``cache``)."""
    share = max(1, cores // max(1, n_local))
    if n_local < 2 or share >= cores:
        return CoreShare(share, f"{share} threads per node (every thread has a core of its own: nothing to measure)")
    key = cache_key(model, cores, n_local)
    known = _read(cache).get(key)
    if isinstance(known, dict) and {"share", "every"} <= known.keys():
        rates = (float(known["share"]), float(known["every"]))
        source = f"measured on this CPU earlier, {cache}"
    else:
        rates = _measure_both(model, share, cores, measure)
        _write(cache, key, {"share": rates[0], "every": rates[1], "at": time.strftime("%Y-%m-%d %H:%M")})
        source = "measured now on this CPU"
    figures = (f"{rates[1]:.1f} tok/s with {cores} threads and OpenMP's passive wait against {rates[0]:.1f} with "
               f"{share} each, one llama.cpp process, {source}")
    if rates[1] >= MARGIN * rates[0]:
        return CoreShare(cores, f"{cores} threads per node, passive wait ({figures})")
    return CoreShare(share, f"{share} thread{'s' if share > 1 else ''} per node ({figures})")


def _measure_both(model: Path, share: int, cores: int, measure: Measure) -> tuple[float, float]:
    """Median rates of the share (spinning wait) and of every core (passive wait), rounds interleaved."""
    shares: list[float] = []
    every: list[float] = []
    for _ in range(ROUNDS):
        shares.append(measure(model, share, False))
        every.append(measure(model, cores, True))
    return statistics.median(shares), statistics.median(every)


def _read(cache: Path) -> dict[str, object]:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(cache: Path, key: str, value: dict[str, object]) -> None:
    data = _read(cache)
    data[key] = value
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        scratch = cache.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(data, indent=1, sort_keys=True))
        scratch.replace(cache)
    except OSError:
        pass  # a cache that cannot be written only costs the next start its measurement


def cpu_model() -> str:
    """The CPU's name as the kernel reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def decode_rate(model: Path, threads: int) -> float:
    """Greedy-free decode: the same token fed back ``TIMED_TOKENS`` times after a short prompt and a warm-up, as
    every node loads the model (no AMX buffers)."""
    import llama_cpp

    from actors.backends.llamacpp.cpu_buffers import buffer_types

    llama_cpp.llama_backend_init()
    buffer_types().allow_amx(False)
    llm = llama_cpp.Llama(str(model), n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)
    try:
        llm.eval(llm.tokenize(b"The measured way to share cores:"))
        token = llm.tokenize(b" the", add_bos=False)[0]
        for _ in range(WARM_TOKENS):
            llm.eval([token])
        started = time.perf_counter()
        for _ in range(TIMED_TOKENS):
            llm.eval([token])
        return TIMED_TOKENS / (time.perf_counter() - started)
    finally:
        llm.close()


if __name__ == "__main__":
    print(f"{decode_rate(Path(sys.argv[1]), int(sys.argv[2])):.3f}")
