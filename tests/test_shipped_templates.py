"""The chat templates shipped in agentgrpo/chat/templates/: found by name, each one present and a
template the embedded tokenizer renders, and a name that is neither shipped nor a file refused."""

from __future__ import annotations

import pytest

from agentgrpo.chat.format import ChatFormat
from agentgrpo.chat.shipped import SHIPPED, load_template, template_path
from agentgrpo.types import Message


def test_every_shipped_template_is_a_file_and_the_folder_holds_no_other():
    folder = template_path("qwen3").parent
    assert {p.stem for p in folder.glob("*.jinja")} == set(SHIPPED)
    for name in SHIPPED:
        assert load_template(name) == template_path(name).read_text()


@pytest.mark.parametrize("name", ["qwen2_5", "llama3_1", "gemma3", "phi3_5"])
def test_a_shipped_template_renders_with_the_embedded_tokenizer(smol_tokenizer, name):
    chat = ChatFormat(smol_tokenizer, template=load_template(name))
    ids = chat.prompt_ids([Message(role="user", content="What is 2 + 2?")])
    assert "What is 2 + 2?" in smol_tokenizer.decode(ids)


def test_a_path_is_read_and_an_unknown_name_is_refused_with_the_list(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_template(str(path)) == "{{ messages[0]['content'] }}"
    with pytest.raises(FileNotFoundError, match="neither a file nor a shipped template.*qwen3"):
        load_template("qwen9")
    with pytest.raises(KeyError, match="shipped: .*llama3_1"):
        template_path("qwen9")
