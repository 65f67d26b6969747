"""A small SentencePiece-style vocabulary that llama.cpp's SPM tokenizer accepts: specials, 256 byte-fallback
tokens, characters and a few hundred common English pieces, so any text tokenizes (unknown characters fall back to
bytes) and ordinary prose takes a realistic number of tokens."""

from __future__ import annotations

import dataclasses
import string

from gguf import GGUFWriter, TokenType

_TEXT = (
    "the of and to in is was that for on with as by at from it an be this are which or his her their not but "
    "had have has were one all there when more other into time some its only after first over new would two "
    "like then them these than been about out also people year long very through light keeper island storm "
    "winter spring north south fishermen returned stories lights seen history strange came every end capital "
    "country city water boils paris france red blue green rain haiku write name three colour what how why "
    "where once upon land far away def return print value number function lighthouse sea ship night day"
)
_WORDS = tuple(_TEXT.split(" "))


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    scores: list[float]
    types: list[int]

    @property
    def size(self) -> int:
        return len(self.tokens)


def build_vocabulary(pad_to: int = 0) -> Vocabulary:
    """The vocabulary, padded with unused tokens up to ``pad_to`` entries (llama.cpp derives some settings from the
    vocabulary size, so a test may need a particular one)."""
    # "<|endoftext|>": llama.cpp sets attributes on it by name for files named like Phi-3 (llama-vocab.cpp).
    tokens = ["<unk>", "<s>", "</s>", "<|endoftext|>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = ["▁"] + list(string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,:;!?'\"()-_=+*/#")
    pieces += ["▁" + w for w in _WORDS] + ["▁" + w.capitalize() for w in _WORDS[:40]]
    seen = set(tokens)
    for piece in pieces:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(TokenType.NORMAL)
    n_special = 4 + 256
    # SPM merges greedily by score: longer pieces score higher so words win over their letters.
    scores = [0.0] * n_special + [float(len(t)) - i * 1e-4 for i, t in enumerate(tokens[n_special:])]
    while len(tokens) < pad_to:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(TokenType.NORMAL)  # UNUSED counts as special: llama.cpp scans every special token per prompt
        scores.append(-1e9)
    return Vocabulary(tokens, scores, [int(t) for t in types])


def write_vocabulary(writer: GGUFWriter, vocab: Vocabulary) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
