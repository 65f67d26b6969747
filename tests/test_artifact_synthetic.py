"""``swarmroute artifact synthetic --arch ARCH --out FILE [--seed N] [--width real]`` (issue #25): the matrix's seeded
models for anyone to check a llama.cpp build against, written by the command exactly as the matrix writes them."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from artifacts.gguf_layout import read_layout
from artifacts.synthetic.architectures import BUILDERS
from artifacts.synthetic.matrix import REAL_V4, case, synthetic_model
from schemas.errors import BadRequestError
from swarmroute.cli import main


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_the_command_writes_the_matrix_model_of_every_architecture(arch: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / f"{arch}.gguf"
    assert main(["artifact", "synthetic", "--arch", arch, "--out", str(out)]) == 0
    builder, quant = synthetic_model(arch)
    same = builder.write(tmp_path / "expected.gguf", quant=quant, seed=16)
    assert filecmp.cmp(out, same, shallow=False)
    assert read_layout(out).architecture == arch
    assert str(out) in capsys.readouterr().out


def test_the_seed_changes_the_weights_not_the_layout(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert main(["artifact", "synthetic", "--arch", "deepseek4", "--out", str(a), "--seed", "1"]) == 0
    assert main(["artifact", "synthetic", "--arch", "deepseek4", "--out", str(b), "--seed", "2"]) == 0
    assert not filecmp.cmp(a, b, shallow=False)
    la, lb = read_layout(a), read_layout(b)
    assert [(t.name, t.shape) for t in la.tensors] == [(t.name, t.shape) for t in lb.tensors]
    assert la.value("deepseek4.hash_layer_count") == case("deepseek4").dims.n_hash


def test_the_real_width_v4_has_the_real_widths() -> None:
    builder, quant = synthetic_model("deepseek4", width="real")
    assert quant == "Q8_0" and builder.n_vocab == REAL_V4.vocab_pad_to == 129280
    shapes = {t.name: t.shape for t in builder.tensors}
    assert shapes["token_embd.weight"] == (4096, 129280)
    assert shapes["blk.0.hc_attn_fn.weight"] == (4 * 4096, (2 + 4) * 4)
    assert shapes["blk.2.attn_q_b.weight"] == (1024, 64 * 512)
    assert shapes["blk.0.ffn_gate_tid2eid.weight"] == (2, 129280)


@pytest.mark.parametrize(("argv", "reason"), [
    (["--arch", "nosuch"], "no synthetic model for architecture 'nosuch'"),
    (["--arch", "llama", "--width", "real"], "no real-width synthetic model for 'llama'"),
])
def test_what_does_not_exist_is_refused_with_the_reason(argv: list[str], reason: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["artifact", "synthetic", *argv, "--out", str(tmp_path / "x.gguf")]) == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(BadRequestError):
        synthetic_model(argv[1], width="real")
