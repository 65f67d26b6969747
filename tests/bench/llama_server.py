"""llama.cpp's own ``llama-server`` for the benchmarks: built once from the llama.cpp that llama-cpp-python vendors,
and run on loopback for the length of an ``async with``.

Not a benchmark itself (the runner only picks up ``bench_*.py``); benchmarks that compare against llama-server import
it. ``python -m tests.bench.llama_server`` builds the binary (if it is not cached yet) and prints its path.

The build: ``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`` (the sdist, ~75 MB) into
``~/.cache/swarmroute/bench/sdist``, unpacked into a scratch directory there; CMake configures ``vendor/llama.cpp``
portable (``GGML_NATIVE=OFF`` with AVX2 on, the AVX-512 parts this CPU has, and no AMX flags: on an AMX CPU a
native build crashes on the first decode, see docs/llamacpp-backend.md), static, without curl, OpenSSL, tests,
examples or the web UI, and builds only the ``llama-server`` target (~10 minutes on 2 cores). The binary is kept as
``~/.cache/swarmroute/bench/llama-server-<version>-<flags hash>/llama-server``; later runs reuse it, and the scratch
tree is removed. A file lock keeps two concurrent builds apart. Nothing of llama.cpp lives in the repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

VERSION = "0.3.36"
BENCH_HOME = Path.home() / ".cache" / "swarmroute" / "bench"
_AVX512 = {"avx512f": "-DGGML_AVX512=ON", "avx512_vnni": "-DGGML_AVX512_VNNI=ON",
           "avx512_bf16": "-DGGML_AVX512_BF16=ON", "avx512vbmi": "-DGGML_AVX512_VBMI=ON"}
"""AVX-512 parts, each built only where this CPU has it: a portable build with AVX-512 on dies of SIGILL on a CPU
without it (the AMD EPYC of these machines has AVX2 only)."""


def _cpu_has() -> set[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    *(flag for cpu, flag in _AVX512.items() if "avx512f" in _cpu_has() and cpu in _cpu_has()),
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)

TARGET = "llama-server"


def _key() -> str:
    return hashlib.sha256("\n".join((VERSION, *CMAKE_FLAGS)).encode()).hexdigest()[:12]


def binary_path() -> Path:
    """Where the cached binary lives (it may not exist yet)."""
    return BENCH_HOME / f"llama-server-{VERSION}-{_key()}" / TARGET


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sdist() -> Path:
    """llama-cpp-python's sdist, downloaded once through pip."""
    folder = BENCH_HOME / "sdist"
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    if not (folder / name).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", str(folder)], check=True)
    return folder / name


def build(jobs: int | None = None, log: bool = True) -> Path:
    """The llama-server binary, built on first use (~10 minutes on 2 cores) and cached under BENCH_HOME."""
    target = binary_path()
    if target.is_file():
        return target
    with _locked(BENCH_HOME / f".llama-server-{_key()}.lock"):
        if target.is_file():  # another process built it while we waited
            return target
        started = time.monotonic()

        def say(text: str) -> None:
            if log:
                print(text, file=sys.stderr, flush=True)

        say(f"building llama-server from llama-cpp-python {VERSION}'s vendored llama.cpp into {target.parent} "
            "(~10 minutes on 2 cores; once)")
        archive = _sdist()
        scratch = Path(tempfile.mkdtemp(prefix="llama-server-build-", dir=BENCH_HOME))
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(scratch, filter="data")
            source = scratch / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
            out = scratch / "build"
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            subprocess.run(["cmake", "-S", str(source), "-B", str(out), *generator, *CMAKE_FLAGS], check=True,
                           stdout=subprocess.DEVNULL if not log else None)
            subprocess.run(["cmake", "--build", str(out), "--target", TARGET, "-j", str(jobs or os.cpu_count() or 1)],
                           check=True, stdout=subprocess.DEVNULL if not log else None)
            built = out / "bin" / TARGET
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(TARGET + ".partial")
            shutil.copy2(built, partial)
            partial.replace(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        say(f"llama-server built in {time.monotonic() - started:.0f} s: {target}")
        return target


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Running:
    """A started llama-server: its base URL (``url + "/v1"`` is the OpenAI API) and process."""

    url: str
    process: asyncio.subprocess.Process
    log: Path


@contextlib.asynccontextmanager
async def llama_server(model: Path, *, threads: int, ctx: int = 4096, extra: tuple[str, ...] = (),
                       chat_template: str | None = None, startup_timeout: float = 300) -> AsyncIterator[Running]:
    """Run llama-server on 127.0.0.1 at a free port with ``threads`` threads (generation and batch) and a ``ctx``
    context in one slot (``--parallel 1``; llama-server's defaults otherwise, so its prompt cache is on), until
    /health says ok; stopped (SIGTERM, then SIGKILL) on exit. ``chat_template`` is one of llama.cpp's built-in
    template names; ``extra`` is appended to the command line (e.g. ``("--chat-template-file", path)``). Its output
    goes to a log file (``Running.log``, removed on exit) whose tail comes with any startup failure."""
    binary = build()
    port = _free_port()
    args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-c", str(ctx), "--parallel", "1", "--no-webui"]
    if chat_template:
        args += ["--chat-template", chat_template]
    args += list(extra)
    log_fd, log_name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
    log = Path(log_name)
    process = await asyncio.create_subprocess_exec(*args, stdin=subprocess.DEVNULL, stdout=log_fd,
                                                   stderr=subprocess.STDOUT)
    os.close(log_fd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                if process.returncode is not None:
                    raise RuntimeError(f"llama-server exited with {process.returncode}:\n{_tail(log)}")
                try:
                    r = await client.get(f"{url}/health")
                    if r.status_code == 200 and r.json().get("status") == "ok":
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llama-server not healthy after {startup_timeout:.0f} s:\n{_tail(log)}")
                await asyncio.sleep(0.1)
        yield Running(url, process, log)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
        log.unlink(missing_ok=True)


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


if __name__ == "__main__":
    print(build())
