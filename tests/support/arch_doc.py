"""``docs/models/architectures.md``: rendered from the architecture table in code (``artifacts.arch_support``) and
the results the matrix test recorded in the same run, so the document cannot claim what the tests did not show."""

from __future__ import annotations

import dataclasses

from artifacts.arch_support import KNOWN_HAZARDS, SUPPORT, ArchSupport
from artifacts.synthetic.matrix import MATRIX, MatrixCase

ChainKey = tuple[str, str, str]
"""(case, quant, split)."""

KV_FORMULA = {
    "deepseek2": "(kv_lora_rank + rope dims) x 2 B per trunk layer (MLA: one K-only row)",
    "gemma3": "2 x n_head_kv x head_dim x 2 B per layer; sliding layers stop growing at the window",
    "gpt-oss": "2 x n_head_kv x head_dim x 2 B per layer; sliding layers stop growing at the window",
}
KV_DEFAULT = "2 x n_head_kv x head_dim x 2 B per layer"
KV_BLOCKWISE = {
    "deepseek4": "one head_dim x 2 B raw row per layer (128-row ring) plus, per 4 positions, a compressed row and an "
                 "indexer row on CSA layers and, per 128, one on HCA layers; measured over positions 2-10, where no "
                 "HCA block completes, so not compared with the planner's whole-context estimate",
}
"""Architectures whose cache grows in blocks: the KV test checks the hops' shares add up, not the planner's
per-position figure (``tests/bench/bench_deepseek4.py`` compares the planner with the real-width model's nodes)."""


@dataclasses.dataclass
class Results:
    chains: dict[ChainKey, tuple[float, bool]] = dataclasses.field(default_factory=dict)
    routes: dict[ChainKey, tuple[float, bool]] = dataclasses.field(default_factory=dict)
    kv: dict[str, tuple[int, list[int]]] = dataclasses.field(default_factory=dict)
    refusals: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    unguarded: dict[str, float | None] = dataclasses.field(default_factory=dict)
    hop_shapes: dict[str, str] = dataclasses.field(default_factory=dict)
    """Case -> what its non-tail hops hand on per position, as the backends report it."""

    def record_chain(self, name: str, quant: str, split: str, diff: float, same: bool, hop_shape: str) -> None:
        self.chains[(name, quant, split)] = (diff, same)
        self.hop_shapes[name] = hop_shape

    def record_route(self, name: str, quant: str, split: str, diff: float, same: bool) -> None:
        self.routes[(name, quant, split)] = (diff, same)

    def record_kv(self, name: str, whole: int, per_hop: list[int]) -> None:
        self.kv[name] = (whole, per_hop)

    def record_refusal(self, name: str, split: str, message: str) -> None:
        self.refusals[(name, split)] = message

    def record_unguarded(self, name: str, diff: float | None) -> None:
        self.unguarded[name] = diff

    def missing(self) -> list[str]:
        """What the matrix test should have recorded and did not (deselected, skipped or failed)."""
        out: list[str] = []
        for c in MATRIX:
            for quant in c.quants:
                out += [f"chain {c.name}-{quant}-{s}" for s in c.splits if (c.name, quant, s) not in self.chains]
                out += [f"route {c.name}-{quant}-{s}" for s in c.splits if (c.name, quant, s) not in self.routes]
            if c.splits and c.arch == c.name and c.name not in self.kv:
                out.append(f"kv {c.name}")
            out += [f"refusal {c.name}-{s}" for s in c.refused_splits if (c.name, s) not in self.refusals]
            if c.why_refused and c.name not in self.unguarded:
                out.append(f"unguarded {c.name}")
        return out


def _proven_cell(c: MatrixCase, r: Results) -> str:
    chains = [s for s in c.splits if any((c.name, q, s) in r.chains for q in c.quants)]
    routes = [s for s in c.splits if any((c.name, q, s) in r.routes for q in c.quants)]
    text = f"chains {', '.join(chains)} x {'/'.join(c.quants)}"
    if routes:
        text += f"; routes through real nodes {', '.join(routes)}"
    return text if c.name == c.arch else f"variant `{c.name}` ({c.about}): {text}"


def _proven_row(arch: str, support: ArchSupport, r: Results) -> str:
    cases = [c for c in MATRIX if c.arch == arch and c.splits]
    names = {c.name for c in cases}
    runs = [v for results in (r.chains, r.routes) for (n, _, _), v in results.items() if n in names]  # both
    proven = "; ".join(_proven_cell(c, r) for c in cases)
    if not all(same for _, same in runs):
        proven += " (GREEDY TOKENS DIFFER)"
    main = next(c for c in cases if c.name == arch)
    whole, hops = r.kv[arch]
    formula = KV_BLOCKWISE.get(arch) or KV_FORMULA.get(arch, KV_DEFAULT)
    kv = f"{whole} = {' + '.join(str(h) for h in hops)} ({formula})"
    shapes = sorted({r.hop_shapes[c.name] for c in cases})
    cells = [f"`{arch}`", support.families, proven, f"{max(d for d, _ in runs)}", kv, ", ".join(shapes),
             f"{support.cut_rules}; unaligned test: {main.unaligned}", support.limits or "-"]
    return "| " + " | ".join(cells) + " |"


def _case_diffs(r: Results, name: str) -> str:
    """What the chains and routes of one case recorded: the largest logits diff, and whether the tokens agreed."""
    runs = [v for results in (r.chains, r.routes) for (n, _, _), v in results.items() if n == name]
    same = "same greedy tokens" if all(s for _, s in runs) else "GREEDY TOKENS DIFFER"
    return f"max abs diff {max(d for d, _ in runs)}, {same}"


def _rules(r: Results) -> list[str]:
    rows = ["| architecture | setting | where llama.cpp derives it | what the shard writer does | shown by |",
            "|---|---|---|---|---|"]
    shown = {"gemma3": "gemma3-62 (n_embd / n_head != head_dim, as in the 27B): without the guard a 2-way chain "
                       "loads, runs and computes other logits (max abs diff > 0.01); the guard refuses every cut. "
                       "gemma3-62-same-scale (n_embd / n_head == head_dim): the guard allows it, and its 2-way "
                       f"chain and route equal the whole model ({_case_diffs(r, 'gemma3-62-same-scale')})",
             "deepseek2": "deepseek2-lite and deepseek2-gating route bit-exactly with the pins; without them the "
                          "lite shard fails to load and the gating chain computes other logits",
             "gemma2": "gemma2 is refused as a whole (see below)"}
    for support in SUPPORT.values():
        for rule in support.rules:
            rows.append(f"| `{support.arch}` | `{rule.setting}` | {rule.source} | {rule.remedy} | "
                        f"{shown.get(support.arch, '-')} |")
    return rows


def _refused_rows(r: Results) -> list[str]:
    rows = ["| architecture | families | reason | shown by |", "|---|---|---|---|"]
    by_arch = {c.arch: c for c in MATRIX if c.why_refused and c.arch == c.name}
    for support in SUPPORT.values():
        if support.status != "refused":
            continue
        c = by_arch.get(support.arch)
        if c is None:
            shown = "reason read from the llama.cpp source (no tiny model built)"
        elif c.why_refused == "scale":
            shown = ("tiny model: without the guard a 2-way chain loads, runs and computes other logits "
                     "(max abs diff > 0.01)")
        elif c.why_refused == "load":
            shown = "tiny model: the whole file runs; without the guard a shard fails to load"
        else:
            shown = "tiny model: the whole file runs; a shard fed hidden states kills the process (SIGABRT)"
        rows.append(f"| `{support.arch}` | {support.families} | {support.reason} | {shown} |")
    return rows


def render(r: Results) -> str:
    missing = r.missing()
    if missing:
        raise AssertionError(f"the matrix did not record {len(missing)} results (run the whole module): "
                             f"{missing[:5]}")
    proven = [c for c in MATRIX if c.splits and c.arch == c.name]
    lines = [
        "# Architectures: what routes bit-exactly across shards, and what is refused",
        "",
        "<!-- Generated by tests/test_arch_matrix.py from artifacts/arch_support.py and the matrix results of the "
        "same run. Do not edit: change the code or the tests, then run "
        "`SWARMROUTE_WRITE_DOCS=1 python -m pytest tests/test_arch_matrix.py`. -->",
        "",
        "A shard GGUF declares fewer layers than its model, and llama.cpp derives some settings from the declared "
        "layer count. `artifacts/arch_support.py` holds, per architecture, whether cutting is proven, the settings "
        "llama.cpp derives from the layer count and what the shard writer does about them. The shard writer "
        "(`artifacts.shard.write_shard`), the store's fetch (`artifacts.fetch.fetch_range`, before any download) and "
        "the llama.cpp backend refuse every cut the table does not allow, naming the file, the architecture, the "
        "setting and the layers.",
        "",
        "Proof: `tests/test_arch_matrix.py` builds a tiny model per architecture (`artifacts/synthetic`: seeded "
        "random weights, F16 and Q8_0, no download), runs it whole in llama.cpp (llama-cpp-python 0.3.36, "
        "llama.cpp 0c1e57098) and as chains of shards, feeding a prompt longer than every sliding window and "
        "decoding greedily. Logits diff is the largest absolute difference of the tail's logits from the whole "
        "model's over every decoded token, split, quantization and route. Every split of every case (the unaligned "
        "ones and the variants' too) also runs as a route through real nodes, tracker, gateway and nats-server "
        "(HTTP on loopback).",
        "",
        "## Proven",
        "",
        "| architecture | families | proven | tail logits max abs diff | KV bytes/token of the tiny model: whole = "
        "per hop (3-way) | hop shape | cut rules | known limits |",
        "|---|---|---|---|---|---|---|---|",
        *[_proven_row(c.name, SUPPORT[c.arch], r) for c in proven],
        "",
        "KV bytes/token: growth of llama.cpp's sequence state per position of context (f16 cache, every layer "
        "inside its window) minus llama.cpp's 12 bytes of per-position bookkeeping per cache. Each hop holds "
        "exactly its own layers' share, and the planner (`artifacts/gguf_shape.py`) predicts the same number.",
        "",
        "## Settings llama.cpp derives from the layer count",
        "",
        "Read from every `switch (hparams.n_layer())` in `src/models/*.cpp` of the vendored llama.cpp and every use "
        "of the resulting model type or of `n_layer()` outside the layer loop. For the other proven architectures "
        "the model type only names the model. Per-layer metadata (sliding-window pattern, leading dense blocks, MTP "
        "block count, per-layer arrays) is rewritten for every shard by `artifacts/layer_metadata.py`.",
        "",
        *_rules(r),
        "",
        "## Refused",
        "",
        *_refused_rows(r),
        "",
        "Ranges refused within proven architectures (tested on the tiny models):",
        "",
        *[f"- `{name}` {split}: {message.split(': ', 1)[1]}" for (name, split), message in sorted(r.refusals.items())
          if SUPPORT[case_arch(name)].status == "proven"],
        "",
        "## Not in the matrix",
        "",
        "Every other architecture is refused by default (the message lists the proven ones). Serve such a model "
        "whole on one node, or cut it anyway with the unproven-architecture override (`--allow-unproven-architecture` "
        "on the command line; `allow_unproven=True` in `write_shard`, `fetch_range`'s `FetchOptions`, the verifier, "
        "`SyncConfig`, `swarmroute.artifact_prep.prepare` and `LlamaCppConfig`), each node deciding for itself. "
        "Known layer-count hazards of architectures outside the matrix, named in the refusal:",
        "",
        *[f"- `{arch}`: {hazard}" for arch, hazard in sorted(KNOWN_HAZARDS.items())],
        "",
    ]
    return "\n".join(lines)


def case_arch(name: str) -> str:
    return next(c.arch for c in MATRIX if c.name == name)
