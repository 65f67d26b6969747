"""llama.cpp's own greedy answer, in this process, as the tests' reference: nothing else in flight."""

from __future__ import annotations

import struct
from pathlib import Path


def greedy_completion(model: Path, prompt: str, n: int, *, threads: int = 1,
                      n_ctx: int = 512) -> tuple[str, list[int], list[int]]:
    """llama-cpp-python's greedy text of ``prompt`` (``n`` tokens), the prompt's ids and the generated ids."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    try:
        ids = llm.tokenize(prompt.encode(), add_bos=True)
        text = llm.create_completion(prompt, max_tokens=n, temperature=0.0)["choices"][0]["text"]  # type: ignore[index]
        llm.reset()
        generated: list[int] = []
        for token in llm.generate(ids, temp=0.0):
            generated.append(int(token))
            if len(generated) == n:
                break
        return text, ids, generated
    finally:
        llm.close()


def id_triples(ids: list[int]) -> list[bytes]:
    """Every run of three consecutive ids as a frame packs them (``<I`` each, bus/frame.py): 12 bytes no
    ciphertext holds by chance."""
    return [struct.pack("<3I", *ids[i:i + 3]) for i in range(len(ids) - 2)]
