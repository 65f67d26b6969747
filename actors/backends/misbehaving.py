"""TEST ONLY (issue #28): a backend that computes wrong on purpose while advertising honest work, to test spot
checks and eviction against. Never built unless ``Settings.test_misbehave`` is set (``SWARMROUTE_TEST_MISBEHAVE``),
and a node built with it says so in its log at start.

* ``noise:SIGMA``: every hidden state it sends gets Gaussian noise of standard deviation ``SIGMA`` added (a tail
  adds it to the hidden states it receives: its logits and tokens are then wrong; a node that is head and tail adds
  it to the largest logits it reports, as a receipt records them);
* ``draw``: a tail that computes right and draws another token than its sampler chose (the runner-up of its
  largest logits where it has them);
* ``skip``: it sends its input on unchanged, as if it had no layers (it still runs them, for its KV);
* ``quant:PATH``: it computes with another quantization of the same model (built by ``swarmroute.backends`` from
  ``PATH``) and advertises the original's file type and artifact hash (``honest_info``).

Everything but ``step`` and ``info`` is the wrapped backend's (KV export, forks, sampling...).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import numpy as np

from actors.backend import Backend, Hidden, StepInput, StepOutput
from schemas.node import BackendInfo


@dataclasses.dataclass(frozen=True)
class Misbehaviour:
    kind: str
    """noise | draw | skip | quant"""
    sigma: float = 0.0
    path: str = ""

    @classmethod
    def parse(cls, text: str) -> Misbehaviour:
        kind, _, arg = text.partition(":")
        if kind == "noise":
            return cls("noise", sigma=float(arg))
        if kind in ("skip", "draw") and not arg:
            return cls(kind)
        if kind == "quant" and arg:
            return cls("quant", path=arg)
        raise ValueError(f"test_misbehave {text!r} is not noise:SIGMA, draw, skip or quant:PATH")


class MisbehavingBackend:
    def __init__(self, inner: Backend, how: Misbehaviour, *, honest_info: BackendInfo | None = None,
                 seed: int = 28) -> None:
        if how.kind == "skip" and inner.is_head:
            raise ValueError("test_misbehave=skip needs a node with an input to send on: not a head")
        if how.kind == "draw" and not inner.is_tail:
            raise ValueError("test_misbehave=draw needs a node that samples: a tail")
        self._inner = inner
        self._how = how
        self._info = honest_info or inner.info
        self._rng = np.random.default_rng(seed)
        self.repaired = False
        """Computes honestly again from now on: its operator fixed it (a test clears the eviction after)."""

    @property
    def info(self) -> BackendInfo:
        return self._info

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        if self.repaired:
            return self._inner.step(batch)
        if self._how.kind == "noise" and self._inner.is_tail:
            # A tail sends no hidden states on: it computes its logits (and samples) from noisy inputs instead.
            batch = [dataclasses.replace(item, hidden=self._noisy(item.hidden)) for item in batch]
        outs = self._inner.step(batch)
        for item, out in zip(batch, outs, strict=True):
            if self._how.kind == "draw" and out.token is not None:
                out.token = _runner_up(out)
            if self._how.kind == "noise" and item.tokens is not None and out.top is not None:
                # Head and tail at once (a 1-node route): no hidden state in or out, so its logits are wrong.
                values = out.top.values + self._rng.normal(0.0, self._how.sigma, out.top.values.shape)
                out.top = dataclasses.replace(out.top, values=values.astype(np.float32))
            if out.hidden is None:
                continue
            if self._how.kind == "noise":
                noise = self._rng.normal(0.0, self._how.sigma, size=out.hidden.shape).astype(np.float32)
                out.hidden = out.hidden + noise
            elif self._how.kind == "skip" and item.hidden is not None:
                out.hidden = np.array(item.hidden, dtype=np.float32, copy=True)
        return outs

    def _noisy(self, hidden: Hidden | None) -> Hidden | None:
        if hidden is None:
            return None
        return hidden + self._rng.normal(0.0, self._how.sigma, size=hidden.shape).astype(np.float32)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _runner_up(out: StepOutput) -> int:
    assert out.token is not None
    if out.top is not None and len(out.top.ids) > 1:
        return int(out.top.ids[1]) if int(out.top.ids[0]) == out.token else int(out.top.ids[0])
    return out.token - 1 if out.token > 0 else out.token + 1


# Class attributes, not only ``__getattr__``: ``isinstance`` against the runtime-checkable backend protocols looks
# members up statically on Python >= 3.12.
def _delegate_property(name: str) -> property:
    return property(lambda self: getattr(self._inner, name))


def _delegate_method(name: str) -> Any:
    def call(self: MisbehavingBackend, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    call.__name__ = name
    return call


for _name in ("layers", "is_head", "is_tail", "max_sessions", "max_batch_tokens"):
    setattr(MisbehavingBackend, _name, _delegate_property(_name))
for _name in ("tokenize", "open_session", "token_bytes", "is_end_of_generation", "close_session", "kv_bytes_in_use",
              "close", "export_kv", "import_kv", "truncate", "kv_continues", "replay_sampled", "fork_session"):
    setattr(MisbehavingBackend, _name, _delegate_method(_name))


def misbehaving(inner: Backend, how: Misbehaviour, *, honest_info: BackendInfo | None = None) -> Backend:
    """``inner`` computing wrong as ``how`` says, typed as the backend it pretends to be."""
    return cast(Backend, MisbehavingBackend(inner, how, honest_info=honest_info))
