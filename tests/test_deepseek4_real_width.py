"""DeepSeek V4 at V4-Flash's real width routes over 2 nodes (issue #25): ``artifacts.synthetic.matrix.REAL_V4`` (hidden
4096, 64 heads x 512, 4 hyper-connection streams, q LoRA 1024, 8 x 1024 output groups, indexer 64 x 128 top-512,
129,280 tokens; 5 layers, 4 experts, Q8_0, ~2.4 GB written at test time) cut after its 3 hash-routed layers.

Through real nodes, tracker, gateway and nats-server the greedy tokens equal the whole model's (and the logits, bit
for bit), and the measured hop payload per position is hc_mult x n_embd x 4 bytes (f32 wire) = 65,536 bytes: what
the planner puts on the wire for the real model (``swarmroute plan deploy/models/deepseek-v4-flash.toml``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

llama_cpp = pytest.importorskip("llama_cpp")  # a skip fails under CI=true (tests/support/ci_strict.py)

from artifacts.synthetic.matrix import REAL_V4, synthetic_model  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from schemas.frame import WireDType  # noqa: E402
from schemas.session import Prompt  # noqa: E402
from tests.support.arch_matrix import RouteHarness, greedy  # noqa: E402
from tests.support.deepseek4 import PREFILL_CHUNK, PayloadRecorder, close_all, open_hop, open_hops  # noqa: E402

pytestmark = pytest.mark.slow

N_DECODE = 3
"""A few tokens: each costs seconds at this width on two shared cores."""
CUT = (0, 3, REAL_V4.n_layers)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    builder, quant = synthetic_model("deepseek4", width="real")
    return builder.write(tmp_path_factory.mktemp("real-v4") / f"real-width-deepseek4-{quant}.gguf", quant=quant,
                         seed=16)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def harness(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RouteHarness]:
    h = await RouteHarness.start(module_nats, tmp_path_factory.mktemp("home"), namespace="realv4",
                                 prefill_chunk=PREFILL_CHUNK, token_timeout_s=300.0, first_token_timeout_s=600.0,
                                 hop_timeout_s=300.0)
    yield h
    await h.stop()


@pytest.mark.asyncio(loop_scope="module")
async def test_real_width_v4_routes_over_two_nodes(model: Path, harness: RouteHarness) -> None:
    whole = open_hop(model, model.parent / "shards", n_ctx=512)
    try:
        assert whole.info.hidden_shape == [REAL_V4.hc_mult, REAL_V4.n_embd]
        assert whole.info.n_vocab == REAL_V4.vocab_pad_to
        tokens = whole.tokenize(Prompt(text="The lighthouse keeper returned to the island every spring."))
        reference = greedy([whole], tokens, N_DECODE)
    finally:
        whole.close()
    hops = open_hops(model, model.parent / "shards", CUT, n_ctx=512)
    tail = PayloadRecorder(hops[-1])
    try:
        got, route = await harness.route(hops, tokens, N_DECODE, tail=tail)
        wire = WireDType.parse(hops[0].info.wire_dtype)
    finally:
        close_all(hops)
    assert len(route) == 2
    assert got.picks == reference.picks
    assert reference.max_diff(got) == 0.0
    assert tail.shapes == {(REAL_V4.hc_mult, REAL_V4.n_embd)}
    assert tail.positions == len(tokens) + N_DECODE - 1
    per_position = tail.payload_bytes / tail.positions
    assert per_position == REAL_V4.hc_mult * REAL_V4.n_embd * wire.itemsize == 65536
