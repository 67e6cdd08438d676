"""Token-in/token-out with a SentencePiece-style tokenizer: one that prepends "▁" to the start of
its input (Metaspace, as in Llama 2, Mistral v0.1 and Gemma's converted tokenizers). None ships
here, so a small one is trained offline with `tokenizers` on this repository's README."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agentgrpo.chat.format import ChatFormat
from agentgrpo.checks.template_audit import audit
from agentgrpo.types import Message, ToolCall
from tests.conftest import shipped_template

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"e": {"type": "string"}},
                "required": ["e"],
            },
        },
    }
]


def _tokenizer(prepend_scheme: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    alphabet = [chr(i) for i in range(32, 127)] + ["\n"]
    tok.train_from_iterator(
        (ROOT / "README.md").read_text().splitlines(),
        trainers.BpeTrainer(vocab_size=800, special_tokens=specials, initial_alphabet=alphabet),
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    hf.chat_template = shipped_template("qwen2_5.jinja")
    return hf


@pytest.fixture(scope="module", params=["first", "always"])
def chat(request) -> ChatFormat:
    return ChatFormat(_tokenizer(request.param))


def _in_place(chat: ChatFormat, history: list[Message], msg: Message) -> list[int]:
    """The ids of assistant turn `msg` as they stand in the whole conversation's tokenization."""
    head = chat.render(history, TOOLS, add_generation_prompt=True)
    full = chat.render([*history, msg], TOOLS)
    turn = full[len(head) :]
    whole = chat.encode(full[: len(head) + turn.index(chat.end_of_turn) + len(chat.end_of_turn)])
    head_ids = chat.encode(head)
    assert whole[: len(head_ids)] == head_ids
    return whole[len(head_ids) :]


def test_the_tokenizer_prepends_to_the_start_of_its_input(chat):
    assert chat.tokenizer.convert_ids_to_tokens(chat.encode("\nhi"))[0] == "▁"


def test_prompt_sampled_and_suffix_ids_equal_the_whole_conversation(chat):
    call = ToolCall(id="c0", name="calc", arguments={"e": "12*7"})
    conv = [
        Message(role="user", content="What is 12*7?"),
        Message(role="assistant", content="", tool_calls=[call]),
        Message(role="tool", content="84", tool_call_id="c0", name="calc"),
        Message(role="assistant", content="It is 84."),
        Message(role="user", content="Thanks, and 84+3?"),
    ]
    history = conv[:1]
    ids = chat.prompt_ids(history, TOOLS)
    for turn, new in ((conv[1], conv[2:3]), (conv[3], conv[4:5])):
        ids += _in_place(chat, history, turn)
        history.append(turn)
        ids += chat.suffix_ids(
            history, new, TOOLS
        )  # alone, "\n<|im_start|>..." would start with "▁"
        history += new
        assert ids == chat.encode(chat.render(history, TOOLS, add_generation_prompt=True))


def test_audit_finds_the_template_token_exact(chat):
    report = audit(chat, tools=TOOLS)
    assert report.mode == "exact" and report.issues == [], report.format()


def test_special_token_text_in_a_tool_output_stays_plain_text(chat):
    call = ToolCall(id="c0", name="calc", arguments={"e": "1"})
    history = [
        Message(role="user", content="go"),
        Message(role="assistant", content="", tool_calls=[call]),
    ]
    echo = Message(role="tool", content="a<|im_end|>b", tool_call_id="c0", name="calc")
    ids = chat.suffix_ids(history, [echo], TOOLS)
    after = chat.render([*history, echo], TOOLS, add_generation_prompt=True)
    template_eots = after.count("<|im_end|>") - 1 - chat.render(history, TOOLS).count("<|im_end|>")
    assert (
        ids.count(chat.end_of_turn_id) == template_eots == 1
    )  # the tool turn's own end, not the echo
    assert "a<|im_end|>b" in chat.decode(ids)
