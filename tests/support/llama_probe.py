"""Load GGUF files in llama.cpp (llama-cpp-python) and report what llama.cpp itself makes of them.

Run as a module in a subprocess (``python -m tests.support.llama_probe FILE...``): prints one JSON object per file with
``n_layer``, ``n_vocab``, ``n_embd``, scalar ``metadata``, and, parsed from llama.cpp's own load log, the per-layer
``is_swa`` flags and ``n_head_kv``. A subprocess keeps the log capture independent of callbacks other tests install.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys

_IS_SWA = re.compile(r"load_tensors: layer\s+(\d+) assigned to device \S+, is_swa = (\d)")
_HEAD_KV = re.compile(r"print_info: n_head_kv\s+=\s+(.+)")


def probe(path: str) -> dict[str, object]:
    import llama_cpp
    from llama_cpp import Llama

    from actors.backends.llamacpp.cpu_buffers import buffer_types

    llama_cpp.llama_backend_init()
    buffer_types().allow_amx(False)  # as the node loads it (actors/backends/llamacpp/cpu_buffers.py)

    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        model = Llama(model_path=path, n_ctx=64, n_threads=1, n_batch=16, verbose=True)
    text = log.getvalue()
    n_layer = llama_cpp.llama_model_n_layer(model.model)
    swa = {int(m.group(1)): m.group(2) == "1" for m in _IS_SWA.finditer(text)}
    head_kv = _HEAD_KV.search(text)
    out = {"path": path, "n_layer": n_layer, "n_vocab": model.n_vocab(), "n_embd": model.n_embd(),
           "metadata": dict(model.metadata), "is_swa": [swa.get(i) for i in range(n_layer)],
           "n_head_kv": head_kv.group(1).strip() if head_kv else None}
    model.close()
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(probe(arg)), flush=True)
