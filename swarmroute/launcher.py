"""``swarmroute up``: embedded NATS, a tracker, N nodes splitting the layers, and the gateway, as child processes.

Each actor is its own process (as on a real fleet), so a node can be killed without taking the others with it.
Ctrl-C (or SIGTERM, or any child dying) stops every child.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bus.server import EmbeddedNats, NatsServerConfig
from schemas.settings import Settings


def split_layers(n_layers: int, n_nodes: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal ranges covering [0, n_layers)."""
    if not 1 <= n_nodes <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {n_nodes} nodes")
    base, extra = divmod(n_layers, n_nodes)
    ranges, start = [], 0
    for i in range(n_nodes):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def _model_layers(args: argparse.Namespace, settings: Settings) -> tuple[str, int]:
    if args.backend == "stub":
        return args.model or "stub-model", args.n_layers
    if args.backend == "torch" and args.model:
        from actors.backends.torch_models import TINY_MODELS

        if args.model in TINY_MODELS:
            return args.model_id or args.model, int(TINY_MODELS[args.model]().num_hidden_layers)
    from artifacts.gguf_layout import read_layout
    from swarmroute.backends import default_model_path

    path = Path(args.model) if args.model else default_model_path(settings)
    args.model = str(path)
    if args.backend == "llamacpp":
        from swarmroute.artifact_prep import import_model

        import_model(settings.home, path)  # once here, rather than racing in every node
    layout = read_layout(path)  # the header only: gguf's GGUFReader takes ~20 s on a 262k vocabulary
    n_layers = int(layout.n_layers)
    name = str(layout.value("general.name") or path.stem)
    return args.model_id or _slug(name), n_layers


def _slug(name: str) -> str:
    """A model name clients can type: 'Gemma 3 270m' -> 'gemma-3-270m' (nodes advertise it as an alias)."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "model"


def _child_argv(args: argparse.Namespace, settings: Settings, nats_url: str, role: str, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "swarmroute", role, "--nats", nats_url, "--home", str(settings.home),
            "--namespace", settings.namespace, "--log-level", args.log_level or "warning"]
    return argv + extra


def _node_extra(args: argparse.Namespace, model_id: str, index: int, layers: tuple[int, int]) -> list[str]:
    extra = ["--backend", args.backend, "--node-id", f"node-{index + 1}", "--layers", f"{layers[0]}:{layers[1]}",
             "--model-id", model_id, "--max-sessions", str(args.max_sessions), "--wire-dtype", args.wire_dtype]
    if args.model:
        extra += ["--model", args.model]
    if args.ctx:
        extra += ["--ctx", str(args.ctx)]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    if args.backend == "stub":
        extra += ["--n-layers", str(args.n_layers), "--hidden-shape", args.hidden_shape]
    return extra


def _wait_ready(url: str, model_id: str, children: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c.poll() is not None for c in children):
            raise RuntimeError("a child process exited during start-up (see its log above)")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                models = json.load(r)["data"]
            if any(model_id in (m["id"], m.get("name"), *m.get("aliases", [])) for m in models if m.get("complete")):
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the swarm did not become ready within {timeout:g}s")


def stop_children(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


class StopRequest:
    """Set by SIGINT or SIGTERM, read by a supervisor loop that stops its children in order.

    Not a ``threading.Event``: its ``set`` takes a lock, and a second signal landing while the handler of the first
    holds it (Ctrl-C twice, or INT then TERM from a process manager) deadlocked the process for good."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def on_stop_signal() -> StopRequest:
    stop = StopRequest()
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    return stop


def run_up(args: argparse.Namespace, settings: Settings) -> int:
    n_nodes = args.nodes or 2  # the distributed route is the product, so it is the default (--nodes 1 for one)
    model_id, n_layers = _model_layers(args, settings)
    ranges = split_layers(n_layers, n_nodes)
    host = args.host or settings.bind_host
    settings.home.mkdir(parents=True, exist_ok=True)
    nats = EmbeddedNats(NatsServerConfig(store_dir=settings.home / "nats-up", host=settings.bind_host))
    nats.start()
    children: list[subprocess.Popen[bytes]] = []
    stop_requested = on_stop_signal()
    try:
        children.append(subprocess.Popen(_child_argv(args, settings, nats.url, "tracker", [])))
        for i, layers in enumerate(ranges):
            children.append(subprocess.Popen(_child_argv(args, settings, nats.url, "node",
                                                         _node_extra(args, model_id, i, layers))))
        children.append(subprocess.Popen(_child_argv(args, settings, nats.url, "gateway",
                                                     ["--host", host, "--port", str(args.port)])))
        url = f"http://{host}:{args.port}"
        _wait_ready(url, model_id, children, timeout=600)
        route = " -> ".join(f"node-{i + 1}[{a},{b})" for i, (a, b) in enumerate(ranges))
        print(f"""
swarmroute is up: {args.backend} backend, model {model_id!r}, route {route}
  NATS      {nats.url}
  gateway   {url}/v1   (OpenAI-compatible)

  curl {url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "{model_id}", "messages": [{{"role": "user", "content": "Hello!"}}], "stream": true}}'

  python -c "import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model_id}', \\
messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

  swarmroute watch --nats {nats.url}     (live sessions and telemetry)
Ctrl-C stops everything.""", flush=True)
        while not stop_requested.is_set():
            if any(c.poll() is not None for c in children):
                print("a child process exited; stopping the swarm", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.3)
        return 0
    finally:
        stop_children(children)
        nats.stop()
