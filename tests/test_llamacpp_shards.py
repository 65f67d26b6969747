"""Layer-range execution: llama.cpp backends over shard GGUFs, chained through StepInput/StepOutput.

What is proven here: 2- and 3-way chains ([0,12)+[12,18), [0,6)+[6,12)+[12,18)) sample exactly what the whole
model samples, with bit-identical tail logits, for a short prompt, for a prompt longer than the 512-token sliding
window (prefilled in two chunks), and for several sessions batched together; each hop keeps its own KV. Also the
shard roles (head takes tokens, other hops hidden states; a middle shard has no vocabulary) and shard reuse.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backend import StepInput, StepOutput  # noqa: E402
from actors.backends import load_backend  # noqa: E402
from actors.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from schemas.errors import BadRequestError, ModelLoadError  # noqa: E402
from schemas.session import Prompt, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

THREADS = 2
N_CTX = 1024
GREEDY = SamplingParams(temperature=0.0)
N = 12
SPLITS = {"2-way": (0, 12, 18), "3-way": (0, 6, 12, 18)}
LONG_TEXT = ("The history of the lighthouse keeper's island is long and strange. Every winter the storms came from "
             "the north, and every spring the fishermen returned with new stories about the lights they had seen. ")


def open_backend(gemma_path: Path, shard_dir: Path, start: int | None = None, end: int | None = None,
                 ) -> LlamaCppBackend:
    b = load_backend("llamacpp", model_path=gemma_path, n_ctx=N_CTX, max_sessions=3, threads=THREADS,
                     layer_start=start, layer_end=end, shard_dir=shard_dir)
    assert isinstance(b, LlamaCppBackend)
    return b


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shards")


@pytest.fixture(scope="module")
def full(gemma_path: Path, shard_dir: Path) -> Iterator[LlamaCppBackend]:
    b = open_backend(gemma_path, shard_dir)
    yield b
    b.close()


@pytest.fixture(scope="module", params=list(SPLITS), ids=list(SPLITS))
def chain(request: pytest.FixtureRequest, gemma_path: Path, shard_dir: Path) -> Iterator[list[LlamaCppBackend]]:
    bounds = SPLITS[request.param]
    hops = [open_backend(gemma_path, shard_dir, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    yield hops
    for h in hops:
        h.close()


def run_step(hops: Sequence[LlamaCppBackend], items: list[StepInput]) -> list[StepOutput]:
    """One step through every hop: the head gets the items, each later hop the previous hop's hidden rows."""
    outputs = hops[0].step(items)
    for hop in hops[1:]:
        items = [StepInput(i.session_id, i.start_position, hidden=o.hidden, sample=i.sample, forks=i.forks)
                 for i, o in zip(items, outputs, strict=True)]
        outputs = hop.step(items)
    return outputs


def generate(hops: Sequence[LlamaCppBackend], prompts: Sequence[list[int]], *, chunk: int = 512,
             stagger: bool = True) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """Greedy runs of all prompts sharing steps: prefill in ``chunk``-token pieces, session k joining at step k
    (``stagger``), every step one batch through the hops. Returns picks and the tail's logits for each pick."""
    ids = [f"s{k}" for k in range(len(prompts))]
    for hop in hops:
        for sid, tokens in zip(ids, prompts, strict=True):
            hop.open_session(sid, prompt_tokens=tokens, sampling=GREEDY)
    picks: list[list[int]] = [[] for _ in prompts]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    done = [0] * len(prompts)  # prompt tokens prefilled so far
    step = 0
    try:
        while any(len(p) < N for p in picks):
            items, owners = [], []
            for k, tokens in enumerate(prompts):
                if (stagger and k > step) or len(picks[k]) >= N:
                    continue
                if done[k] < len(tokens):
                    piece = tokens[done[k]:done[k] + chunk]
                    items.append(StepInput(ids[k], done[k], tokens=piece, sample=done[k] + len(piece) == len(tokens)))
                    done[k] += len(piece)
                else:
                    items.append(StepInput(ids[k], len(tokens) + len(picks[k]) - 1, tokens=[picks[k][-1]], sample=True))
                owners.append(k)
            outputs = run_step(hops, items)
            for k, item, out in zip(owners, items, outputs, strict=True):
                if item.sample:
                    assert out.token is not None
                    picks[k].append(out.token)
                    logits[k].append(hops[-1].last_logits(ids[k]))
                else:
                    assert out.token is None
            step += 1
    finally:
        for hop in hops:
            for sid in ids:
                hop.close_session(sid)
    return picks, logits


def assert_same(full_run: tuple[list[list[int]], list[list[np.ndarray]]],
                chain_run: tuple[list[list[int]], list[list[np.ndarray]]]) -> None:
    (full_picks, full_logits), (chain_picks, chain_logits) = full_run, chain_run
    assert chain_picks == full_picks
    for a, b in zip(full_logits, chain_logits, strict=True):
        assert max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True)) == 0.0


def test_shard_roles(chain: list[LlamaCppBackend], full: LlamaCppBackend, shard_dir: Path) -> None:
    head, *middle, tail = chain
    assert head.is_head and not head.is_tail and tail.is_tail and not tail.is_head
    assert head.layers.start == 0 and tail.layers.end == 18
    for before, after in zip(chain, chain[1:], strict=False):
        assert before.layers.end == after.layers.start
    for hop in chain:
        assert hop.info.n_layers == 18 and hop.info.hidden_shape == [640] and hop.model_file.parent == shard_dir
    for hop in middle:
        assert hop.info.n_vocab == 1 and not hop.is_head and not hop.is_tail  # no vocabulary, no lm_head
    assert tail.info.n_vocab == full.info.n_vocab
    tokens = head.tokenize(Prompt(text="Hello"))
    assert tokens == full.tokenize(Prompt(text="Hello"))
    with pytest.raises(BadRequestError, match="only the head"):
        tail.tokenize(Prompt(text="Hello"))
    for hop in chain[1:]:
        hop.open_session("roles", prompt_tokens=tokens, sampling=GREEDY)
        try:
            with pytest.raises(BadRequestError, match="hidden states"):
                hop.step([StepInput("roles", 0, tokens=tokens)])
            with pytest.raises(BadRequestError, match="per row"):
                hop.step([StepInput("roles", 0, hidden=np.zeros((len(tokens), 320), dtype=np.float32))])
        finally:
            hop.close_session("roles")


def test_short_prompt_chain_equals_the_whole_model(chain: list[LlamaCppBackend], full: LlamaCppBackend) -> None:
    prompts = [full.tokenize(Prompt(text="The capital of France is"))]
    assert_same(generate([full], prompts), generate(chain, prompts))


def test_prompt_longer_than_the_sliding_window(chain: list[LlamaCppBackend], full: LlamaCppBackend) -> None:
    text = LONG_TEXT * 18 + "In the end, the keeper"
    prompts = [full.tokenize(Prompt(text=text))]
    # Longer than Gemma 3's 512-token window (prefilled in two chunks): only past the window do windowed and
    # global layers differ, so this is where a shard with the wrong per-layer window pattern would go wrong.
    assert 512 < len(prompts[0]) < N_CTX - N
    assert_same(generate([full], prompts), generate(chain, prompts))


def test_concurrent_sessions_through_the_chain(chain: list[LlamaCppBackend], full: LlamaCppBackend) -> None:
    texts = ["The capital of France is", "def fibonacci(n):", LONG_TEXT * 2]
    prompts = [full.tokenize(Prompt(text=t)) for t in texts]
    # Chunks of 64 make the third prompt's prefill span steps shared with the others' decodes.
    full_run = generate([full], prompts, chunk=64)
    assert_same(full_run, generate(chain, prompts, chunk=64))


def test_shard_files_are_cut_once_and_checked(gemma_path: Path, shard_dir: Path,
                                              chain: list[LlamaCppBackend]) -> None:
    tail_file = chain[-1].model_file
    before = tail_file.stat().st_mtime_ns
    again = open_backend(gemma_path, shard_dir, chain[-1].layers.start, 18)
    try:
        assert again.model_file == tail_file and tail_file.stat().st_mtime_ns == before  # reused, not rewritten
    finally:
        again.close()
    direct = load_backend("llamacpp", model_path=tail_file, n_ctx=256, max_sessions=1, threads=THREADS)
    try:
        assert (direct.layers.start, direct.layers.end) == (chain[-1].layers.start, 18) and direct.is_tail
    finally:
        direct.close()
    with pytest.raises(ModelLoadError, match="is a shard of layers"):
        load_backend("llamacpp", model_path=tail_file, layer_start=0, layer_end=18, threads=THREADS)


def test_a_shared_shard_directory_never_hands_one_models_layers_to_another(tmp_path: Path) -> None:
    """Two models cut into the same directory for the same range get their own shard files, and each shard's
    output is its own model's (the first version reused ``shard-a-b.gguf`` whatever model wrote it)."""
    from tests.support.gguf_factory import write_tiny_gguf

    shared = tmp_path / "shards"
    sources = [write_tiny_gguf(tmp_path / f"m{seed}" / "model.gguf", n_layers=4, seed=seed) for seed in (1, 2)]
    outputs = []
    for source in sources:
        tail = load_backend("llamacpp", model_path=source, layer_start=2, layer_end=4, shard_dir=shared,
                            n_ctx=64, max_sessions=1, threads=THREADS)
        try:
            tail.open_session("s", prompt_tokens=[1], sampling=SamplingParams(temperature=0.0))
            hidden = np.ones((1, tail.info.hidden_size), dtype=np.float32)
            tail.step([StepInput("s", 0, hidden=hidden, sample=True)])
            outputs.append((tail.model_file, tail.last_logits("s")))
        finally:
            tail.close()
    assert outputs[0][0] != outputs[1][0] and outputs[0][0].parent == outputs[1][0].parent == shared
    assert not np.array_equal(outputs[0][1], outputs[1][1])


def generate_choices(hops: Sequence[LlamaCppBackend], tokens: list[int], n: int,
                     ) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """n > 1 through the hops: the prompt's step forks every hop's session into n choices, which then decode in
    one batch per step; the tail's picks and logits per choice."""
    ids = ["c0", *(f"c{i}" for i in range(1, n))]
    for hop in hops:
        hop.open_session("c0", prompt_tokens=tokens, sampling=GREEDY)
    try:
        out = run_step(hops, [StepInput("c0", 0, tokens=tokens, sample=True, forks=tuple(ids[1:]))])[0]
        picks = [[out.token], *([f.token] for f in out.forks)]
        logits = [[hops[-1].last_logits(sid)] for sid in ids]
        for hop in hops:  # every hop holds the prompt for every choice
            assert [hop.kv_cells(sid) for sid in ids] == [(0, len(tokens) - 1)] * n
        while len(picks[0]) < N:
            at = len(tokens) + len(picks[0]) - 1
            outs = run_step(hops, [StepInput(sid, at, tokens=[p[-1]], sample=True)  # type: ignore[list-item]
                                   for sid, p in zip(ids, picks, strict=True)])
            for sid, p, lg, o in zip(ids, picks, logits, outs, strict=True):
                p.append(o.token)
                lg.append(hops[-1].last_logits(sid))
        return picks, logits  # type: ignore[return-value]
    finally:
        for hop in hops:
            for sid in ids:
                hop.close_session(sid)


def test_choices_fork_on_every_hop_and_equal_the_whole_model(chain: list[LlamaCppBackend],
                                                            full: LlamaCppBackend) -> None:
    tokens = full.tokenize(Prompt(text="The capital of France is"))
    full_run = generate_choices([full], tokens, 3)
    assert_same(full_run, generate_choices(chain, tokens, 3))
