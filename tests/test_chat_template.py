"""Chat templates: the Gemma fallback against llama.cpp's own built-in Gemma formatter, GGUF templates first."""

from __future__ import annotations

import ctypes

import pytest

from actors.backends.llamacpp.chat_template import FAMILY_TEMPLATES, ChatTemplate, select_template
from schemas.errors import BadRequestError

llama_cpp = pytest.importorskip("llama_cpp")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour. ünïcødé ✓"}],
]


def llama_cpp_builtin(template: str, messages: list[dict[str, str]], add_assistant: bool) -> str:
    """Render with libllama's built-in named template (llm_chat_apply_template), the reference."""
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages])
    size = 4096
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(messages), add_assistant, buf, size)
    assert 0 < n < size
    return buf.raw[:n].decode()


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma_fallback_matches_llama_cpp_builtin_gemma(messages: list[dict[str, str]],
                                                        add_generation_prompt: bool) -> None:
    template = select_template(None, "gemma3", bos_token="<bos>", eos_token="<eos>")
    assert template is not None and template.origin == "fallback:gemma3"
    rendered = template.render(messages, add_generation_prompt=add_generation_prompt)
    # Our template writes BOS (as Google's does); llama.cpp's built-in leaves BOS to the tokenizer.
    assert rendered.startswith("<bos>")
    assert rendered[len("<bos>"):] == llama_cpp_builtin("gemma", messages, add_generation_prompt)


def test_gemma_turn_format_and_system_folding() -> None:
    template = select_template(None, "gemma3", bos_token="<bos>")
    assert template is not None
    text = template.render(CONVERSATIONS[1])
    assert text == ("<bos><start_of_turn>user\nAnswer in one word.\n\nCapital of France?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    assert "system" not in text


def test_developer_role_and_text_parts_are_accepted() -> None:
    template = select_template(None, "gemma3", bos_token="<bos>")
    assert template is not None
    as_parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}]},
                {"role": "user", "content": "Hi"}]
    plain = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert template.render(as_parts) == template.render(plain)


def test_bad_conversations_are_bad_requests() -> None:
    template = select_template(None, "gemma", bos_token="<bos>")
    assert template is not None
    with pytest.raises(BadRequestError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(BadRequestError, match="text content"):
        template.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(BadRequestError, match="empty"):
        template.render([])


def test_gguf_template_wins_over_the_family_fallback() -> None:
    source = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}]{% endfor %}{{ eos_token }}"
    template = select_template(source, "gemma3", bos_token="<s>", eos_token="</s>")
    assert template is not None and template.origin == "gguf"
    assert template.render(CONVERSATIONS[1]) == "[system|Answer in one word.][user|Capital of France?]</s>"


def test_gguf_templates_get_transformers_helpers() -> None:
    source = "{{ messages | tojson }}{% if x is defined %}{{ raise_exception('x') }}{% endif %}{{ strftime_now('%Y') }}"
    template = ChatTemplate(source, "gguf")
    text = template.render([{"role": "user", "content": "é"}])
    assert text.startswith('[{"role": "user", "content": "é"}]') and text[-4:].isdigit()
    failing = ChatTemplate("{{ raise_exception('no tools here') }}", "gguf")
    with pytest.raises(BadRequestError, match="no tools here"):
        failing.render([{"role": "user", "content": "x"}])
    with pytest.raises(BadRequestError, match="does not compile"):
        ChatTemplate("{% for %}", "gguf")


def test_unknown_family_without_template_has_none() -> None:
    assert select_template(None, "some-new-arch") is None
    assert set(FAMILY_TEMPLATES) >= {"gemma", "gemma2", "gemma3"}
