"""Prompt -> ids and id -> bytes for the tiny byte-level tokenizer and the real Gemma tokenizer (from its GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.backends.torch.backend import TorchConfig
from actors.backends.torch.gguf import GGUFModel
from actors.backends.torch.tokens import TokenCodec, build_tiny_tokenizer
from schemas.errors import BadRequestError
from schemas.session import Prompt

TRICKY = "naïve café — 你好 🙂🚀\n\ttabs  double  spaces, ʕ•ᴥ•ʔ \x00 end"


@pytest.fixture(scope="module")
def gemma_codec(gemma_path: Path) -> TokenCodec:
    root = TorchConfig().cache_dir
    assert root is not None
    return TokenCodec.load(GGUFModel(gemma_path, root).tokenizer_dir(), [])


def assert_bytes_round_trip(codec: TokenCodec, text: str) -> None:
    ids = codec.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    assert b"".join(codec.token_bytes(i) for i in ids) == text.encode()


def test_tiny_tokenizer_round_trips_bytes_exactly() -> None:
    codec = TokenCodec(build_tiny_tokenizer(), [])
    assert_bytes_round_trip(codec, TRICKY)
    ids = codec.tokenize(Prompt(text="hé"))
    assert ids[0] == codec.tokenizer.bos_token_id and len(ids) == 1 + len("hé".encode())
    # A multi-byte character arrives as several tokens, each one byte: the node stitches them.
    assert [codec.token_bytes(i) for i in ids[2:]] == [bytes([b]) for b in "é".encode()]


def test_tiny_chat_template_and_end_of_generation() -> None:
    codec = TokenCodec(build_tiny_tokenizer(), [])
    ids = codec.tokenize(Prompt(messages=[{"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": "hi"}]))
    assert b"".join(codec.token_bytes(i) for i in ids) == b"<system>be brief\n<user>hi\n<assistant>"
    assert codec.is_end_of_generation(codec.tokenizer.eos_token_id)
    assert not codec.is_end_of_generation(ids[-1])
    assert codec.token_bytes(codec.tokenizer.bos_token_id) == b""
    with pytest.raises(BadRequestError):
        codec.tokenize(Prompt())


def test_an_assistant_turns_reasoning_content_reaches_the_template() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{% if m.get('reasoning_content') %}"
                               "<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}\n{% endfor %}")
    codec = TokenCodec(tokenizer, [])
    ids = codec.tokenize(Prompt(messages=[{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "hello", "reasoning_content": "greet"}]))
    assert b"".join(codec.token_bytes(i) for i in ids) == b"<user>hi\n<assistant><think>greet</think>hello\n"
    assert codec.template_source == tokenizer.chat_template


@pytest.mark.slow
def test_gemma_token_bytes_are_exact_including_byte_fallback(gemma_codec: TokenCodec) -> None:
    codec = gemma_codec
    assert_bytes_round_trip(codec, TRICKY)
    # Characters outside the vocabulary come as <0xNN> pieces: each must give its raw byte.
    rare = "\U0001d11e\U000e0041"
    ids = codec.tokenizer(rare, add_special_tokens=False)["input_ids"]
    pieces = codec.tokenizer.convert_ids_to_tokens(ids)
    assert any(p.startswith("<0x") for p in pieces)
    assert b"".join(codec.token_bytes(i) for i in ids) == rare.encode()


@pytest.mark.slow
def test_gemma_chat_prompt_uses_the_turn_format(gemma_codec: TokenCodec) -> None:
    codec = gemma_codec
    ids = codec.tokenize(Prompt(messages=[{"role": "system", "content": "Be terse."},
                                          {"role": "user", "content": "Capital of France?"}]))
    tok = codec.tokenizer
    expected = tok("<start_of_turn>user\nBe terse.\n\nCapital of France?<end_of_turn>\n<start_of_turn>model\n",
                   add_special_tokens=False)["input_ids"]
    assert ids == [tok.bos_token_id, *expected]
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    assert codec.is_end_of_generation(end_of_turn) and codec.is_end_of_generation(tok.eos_token_id)
    assert codec.token_bytes(end_of_turn) == b""
