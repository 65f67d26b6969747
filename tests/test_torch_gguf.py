"""GGUF files through the torch backend: converted per part, split across nodes, exact.

The reference is transformers' own GGUF loader (whole model, dequantized, one process): it shares no conversion
code path with the per-part cache except transformers' tensor processors. The bundled Gemma 3 270M tests are slow;
a tiny random llama GGUF covers the llama-specific conversion (q/k un-permutation, untied head) quickly.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from actors.backends.torch.backend import TorchConfig, load_torch
from actors.backends.torch.gguf import GGUFModel, cache_dir_for
from schemas.session import Prompt
from tests.support.gguf_factory import write_tiny_gguf
from tests.support.torch_route import WireRoute, build_route, generate_reference

REPO = Path(__file__).resolve().parents[1]


def shared_cache() -> Path:
    root = TorchConfig().cache_dir
    assert root is not None
    return root


@pytest.fixture(scope="module")
def gemma_reference(gemma_path: Path) -> Iterator[PreTrainedModel]:
    ref = AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                               dtype=torch.float32)
    yield ref.eval()
    del ref
    gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("bounds", [(0, 12, 18), (0, 5, 11, 18)], ids=["2-node", "3-node"])
def test_gemma_route_greedy_tokens_equal_generate(gemma_path: Path, gemma_reference: PreTrainedModel,
                                                  bounds: tuple[int, ...]) -> None:
    route = WireRoute(build_route(str(gemma_path), bounds))
    ids = route.backends[0].tokenize(Prompt(text="The capital of France is"))
    expected = generate_reference(gemma_reference, ids, 8)

    sid, got = route.generate(ids, len(expected), chunk=4)

    assert got == expected
    with torch.no_grad():
        states = gemma_reference(torch.tensor([ids + got[:-1]]), output_hidden_states=True).hidden_states
    for hop, boundary in enumerate(bounds[1:-1]):
        sent, desired = np.concatenate(route.hop_outputs[sid][hop]), states[boundary][0].numpy()
        np.testing.assert_allclose(sent, desired, rtol=1e-4, atol=1e-6 * float(np.abs(desired).max()))
    for backend in route.backends:
        backend.close()


def test_llama_gguf_route_equals_transformers_gguf_loader(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "model" / "tiny-llama.gguf", n_layers=4, n_vocab=64, rope_freqs=False, seed=3)
    route = WireRoute([load_torch(model=str(gguf), layer_start=a, layer_end=b, cache_dir=tmp_path / "cache")
                       for a, b in ((0, 2), (2, 4))])
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = [1, *range(3, 40)]
    expected = generate_reference(ref, ids, 12)

    sid, got = route.generate(ids, len(expected), chunk=5)

    assert got == expected
    with torch.no_grad():
        states = ref(torch.tensor([ids + got[:-1]]), output_hidden_states=True).hidden_states
    sent, desired = np.concatenate(route.hop_outputs[sid][0]), states[2][0].numpy()
    np.testing.assert_allclose(sent, desired, rtol=1e-4, atol=1e-5 * float(np.abs(desired).max()))


@pytest.mark.slow
def test_parts_are_converted_only_for_the_layers_a_node_serves(gemma_path: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Reuse the slow-to-parse config and tokenizer; start with no converted weights at all.
    shared = cache_dir_for(gemma_path, shared_cache())
    GGUFModel(gemma_path, shared_cache()).config()
    fresh = cache_dir_for(gemma_path, tmp_path)
    fresh.mkdir(parents=True)
    shutil.copytree(shared / "config", fresh / "config")

    middle = load_torch(model=str(gemma_path), layer_start=6, layer_end=9, cache_dir=tmp_path)
    assert sorted(p.name for p in (fresh / "parts").glob("*.safetensors")) == [
        "layer-0006.safetensors", "layer-0007.safetensors", "layer-0008.safetensors"]
    assert not (fresh / "tokenizer").exists()  # a middle node never tokenizes
    middle.close()

    # Once cached, the GGUF is not read again.
    import gguf

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was parsed although every part was cached")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    again = load_torch(model=str(gemma_path), layer_start=7, layer_end=9, cache_dir=tmp_path)
    assert sorted(again.shard.layers) == [7, 8]


# Peak RSS is read from VmHWM, this process's own high-water mark: getrusage's ru_maxrss would report the pytest
# parent's peak, which Linux carries over into a forked-and-exec'd child.
PEAK_SCRIPT = textwrap.dedent("""
    import json, pathlib, sys
    import torch, transformers  # imported before the baseline: the same for every shard
    from actors.backends.torch.models import prepare
    from actors.backends.torch.backend import load_torch

    def status_kib(field):
        line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    path, start, end, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    prepare(path, pathlib.Path(cache))
    baseline = status_kib("VmRSS")
    backend = load_torch(model=path, layer_start=start, layer_end=end, cache_dir=cache)
    loaded = status_kib("VmHWM")
    # Weights are memory-mapped from the part cache: fault every page in, so the peak is the whole working set.
    for module in backend.shard.modules():
        for p in module.parameters():
            float(p.sum())
    print(json.dumps({"baseline": baseline, "loaded": loaded, "peak": status_kib("VmHWM"),
                      "held": backend.shard.parameter_bytes()}))
""")


def peak_load_bytes(gemma_path: Path, start: int, end: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(gemma_path), str(start), str(end),
                          str(shared_cache())], capture_output=True, text=True, cwd=REPO, check=True, timeout=900)
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_a_middle_shard_never_materializes_the_embeddings(gemma_path: Path) -> None:
    for bounds in ((0, 6), (6, 12)):  # make sure both are converted before measuring
        load_torch(model=str(gemma_path), layer_start=bounds[0], layer_end=bounds[1]).close()
    config = GGUFModel(gemma_path, shared_cache()).config()
    embedding_bytes = config.vocab_size * config.hidden_size * 4

    head = peak_load_bytes(gemma_path, 0, 6)
    middle = peak_load_bytes(gemma_path, 6, 12)

    for name, m in (("head [0,6)", head), ("middle [6,12)", middle)):
        print(f"{name}: peak RSS growth {(m['loaded'] - m['baseline']) / 2**20:.0f} MiB after loading, "
              f"{(m['peak'] - m['baseline']) / 2**20:.0f} MiB with every weight touched; holds "
              f"{m['held'] / 2**20:.0f} MiB of weights; the embedding matrix is {embedding_bytes / 2**20:.0f} MiB")
    assert head["peak"] - head["baseline"] >= embedding_bytes  # the measurement sees a materialized matrix
    assert middle["peak"] - middle["baseline"] < embedding_bytes / 2
    assert middle["held"] < embedding_bytes / 2
