"""What crosses a layer boundary in a llama.cpp graph, per architecture: how many residual streams per position, the
graph node a shard's last layer leaves them in, and the node a later shard must overwrite to take them in; and
whether the architecture's cache moves only whole sequences.

Most architectures keep one ``n_embd`` residual stream, left in ``l_out-<il>`` and taken in through
``llama_batch.embd``. deepseek4 keeps ``hc_mult`` hyper-connection streams (``[n_embd, hc_mult, n_tokens]``),
names each layer's output ``l_last-<il>`` (models/deepseek4.cpp), and repeats its one ``n_embd`` input row into the
streams at ``hc_init``: a shard after the head overwrites ``hc_init`` (``ggml_capture.LayerCapture(inject=...)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class StreamLayout:
    streams: int = 1
    """Residual streams per position; a hop's row is ``streams * n_embd`` floats."""
    output_node: str = "l_out"
    """Name stem of a layer's output node (``<stem>-<il>``)."""
    input_node: str = ""
    """The node a non-head shard overwrites with the previous shard's streams; "" when ``llama_batch.embd`` takes
    them as they are."""
    whole_sequence_kv: bool = False
    """The architecture's llama.cpp cache copies only whole sequences (``kv_state.KvCells.whole_sequences``)."""

    @property
    def one_sequence_per_decode(self) -> bool:
        """llama.cpp splits a multi-sequence batch of this architecture into ubatches by sequence, so captured and
        injected rows would come in another order than the batch's: decode one sequence at a time."""
        return self.streams > 1

    def hidden_shape(self, n_embd: int) -> list[int]:
        return [self.streams, n_embd] if self.streams > 1 else [n_embd]


def stream_layout(architecture: str, value: Callable[[str, Any], Any]) -> StreamLayout:
    """The layout of a GGUF of ``architecture``; ``value(key, default)`` reads its metadata."""
    if architecture == "deepseek4":
        return StreamLayout(int(value("deepseek4.hyper_connection.count", 4)), "l_last", "hc_init", True)
    if architecture in RECURRENT_STATE:
        return StreamLayout(whole_sequence_kv=True)
    return StreamLayout()


RECURRENT_STATE = frozenset({"qwen35moe", "qwen35"})
"""Hybrid models whose Gated DeltaNet layers keep one recurrent state per sequence (llama_memory_recurrent): it holds
no positions, so a range ``[a, b)`` of it cannot be exported (llama.cpp copies the state of the sequence's last
position: an import resumed at ``b`` computed other logits, max abs diff 4.9 on the tiny qwen35moe) nor truncated
beyond the rollback ring. They move whole sequences, as deepseek4's cache does."""
