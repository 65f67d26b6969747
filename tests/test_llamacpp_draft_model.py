"""``swarmroute node --draft-model`` (issue #20): a head given a draft GGUF drafts with it for speculative sessions
(``SWARMROUTE_SPECULATION=model``), on real llama.cpp node processes of the bundled model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.swarm import make_settings

pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.slow
MODEL = "gemma"


async def test_a_head_with_a_draft_model_speculates_with_it(nats_server: Any, gemma_path: Path, tmp_path: Path,
                                                           swarms: Any) -> None:
    """``swarmroute node --draft-model`` on the head, ``SWARMROUTE_SPECULATION=model``: the drafts come from that
    model (here the served model itself, whole, so greedy drafts are nearly always what the route computes)."""
    from actors.tracker import Tracker
    from gateway.app import Gateway
    from tests.support.swarm import wait_model

    settings = make_settings(nats_server.url, tmp_path / "home", speculation="model", speculative_windows=1,
                             speculative_max_k=4, prefix_cache_mb=0, token_timeout_s=60.0,
                             first_token_timeout_s=120.0, hop_timeout_s=60.0)
    common = ["--backend", "llamacpp", "--model", str(gemma_path), "--model-id", MODEL, "--threads", "1",
              "--ctx", "1024", "--max-sessions", "2"]
    await swarms.node_process(settings, "head", [*common, "--layers", "0:9", "--draft-model", str(gemma_path)])
    await swarms.node_process(settings, "tail", [*common, "--layers", "9:18"])
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, MODEL, timeout=120, n_nodes=2)
    reply = await openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                                     timeout=300).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True})
    view = (reply.model_extra or {})["swarmroute"]["speculation"]
    assert view["source"] == "model" and view["drafts_offered"] > 0, view
    assert view["acceptance"] > 0.5, view
