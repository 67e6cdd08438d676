"""The template audit on the real SmolLM2 tokenizer and the original templates of model families."""

import copy

import pytest

from agentgrpo.chat.format import ChatFormat, TemplateError
from agentgrpo.checks.template_audit import ONE_CALL, audit, audit_template, require_token_safe
from envs.calculator import CalculatorEnv
from tests.conftest import shipped_template, template_file
from tests.test_rollout import TASK


def kinds(report):
    return {(i.kind, i.fatal) for i in report.issues}


@pytest.mark.parametrize("name", [None, "qwen2_5.jinja", "qwen3_instruct_2507.jinja"])
def test_prefix_preserving_templates_are_exact(smol_tokenizer, name):
    report = audit_template(smol_tokenizer, shipped_template(name) if name else None)
    assert report.mode == "exact" and report.prefix_preserving and not report.issues
    assert (
        report.conversations == 12 and report.turns == 29
    )  # every turn of every conversation walked


def test_qwen3_is_refused_with_the_reasons(smol_tokenizer):
    report = audit_template(smol_tokenizer, shipped_template("qwen3.jinja"))
    assert report.mode == "refuse" and not report.prefix_preserving
    whys = {i.why for i in report.issues}
    assert whys == {
        "it drops the reasoning (<think>...</think>) of earlier assistant turns",
        "it renders an empty <think></think> block in the last assistant turn only",
    }
    reasoning = next(i for i in report.issues if i.conversation == "reasoning")
    assert reasoning.turn == 1 and "<think>\\n12 * 7 = 84.\\n</think>" in reasoning.detail
    text = report.format()
    assert "NOT token-safe" in text and "rollout.template_fallback=keep_history" in text
    # tool turns without a new user message keep reasoning: that shape alone is fine
    assert not any(i.conversation == "reasoning with tools" and i.turn == 1 for i in report.issues)


def test_keep_history_is_accepted_only_when_chosen(smol_tokenizer):
    report = audit_template(
        smol_tokenizer, shipped_template("qwen3.jinja"), fallback="keep_history"
    )
    assert report.mode == "keep_history" and report.fallback_works
    assert "[fallback] rewrites_history" in report.format()


def test_preserve_thinking_switch_is_suggested(smol_tokenizer):
    # a Qwen3 variant with the switch newer Qwen templates have
    t = shipped_template("qwen3.jinja").replace(
        "{%- if loop.index0 > ns.last_query_index %}",
        "{%- if (preserve_thinking is defined and preserve_thinking) or loop.index0 > "
        "ns.last_query_index %}",
    )
    report = audit_template(smol_tokenizer, t)
    assert "chat_template_kwargs={preserve_thinking: true}" in report.format()
    fixed = audit_template(smol_tokenizer, t, template_kwargs={"preserve_thinking": True})
    # reasoning now survives; the empty think block of a last turn without reasoning still does not
    assert {i.why for i in fixed.issues} == {
        "it renders an empty <think></think> block in the last assistant turn only"
    }


def test_wrong_end_of_turn_and_missing_tool_support(smol_tokenizer):
    llama = audit_template(smol_tokenizer, shipped_template("llama3_1.jinja"))
    assert llama.mode == "refuse" and ("no_end_of_turn", True) in kinds(llama)
    assert "--end-of-turn" in llama.format()
    phi = audit_template(smol_tokenizer, shipped_template("phi3_5.jinja"))
    assert phi.mode == "refuse" and not phi.fallback_works
    assert any(i.why == "it puts '<|im_end|>' only after the final turn" for i in phi.issues)
    assert "use a tool-aware template" in phi.format()
    bad = audit_template(smol_tokenizer, end_of_turn="<|not_a_token|>")
    assert bad.mode == "refuse" and ("end_of_turn", True) in kinds(bad)


def test_llama_with_its_tokens_is_exact_and_the_parser_is_checked(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|eot_id|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|python_tag|>",
            ]
        }
    )
    report = audit_template(
        tok, shipped_template("llama3_1.jinja"), parser="llama3_json", end_of_turn="<|eot_id|>"
    )
    assert report.mode == "exact"
    # warnings only: no parallel calls in Llama 3.1, and "\n\n" + "12" merge differently when the
    # text is tokenized in one piece (harmless token-in/token-out, so not fatal)
    assert kinds(report) == {("render_error", False), ("retokenizes", False)}
    assert "max_tool_calls_per_turn=1" in report.format()
    # ...and the advice holds: the rollout renders only the call the env ran (test_rollout checks
    # it)
    assert "answers the others with a too_many_calls error" in report.format()
    hermes = audit_template(tok, shipped_template("llama3_1.jinja"), end_of_turn="<|eot_id|>")
    assert ("parser_mismatch", False) in kinds(
        hermes
    ) and "model.tool_parser=llama3_json" in hermes.format()


def test_require_token_safe_uses_the_env_shape(smol_tokenizer, chat):
    report = require_token_safe(chat, CalculatorEnv(), TASK)
    assert report.mode == "exact" and report.conversations == 12  # tools: tool shapes included
    qwen3 = ChatFormat(smol_tokenizer, template=shipped_template("qwen3.jinja"))
    with pytest.raises(TemplateError, match="not token-safe for this environment") as e:
        require_token_safe(qwen3, CalculatorEnv(), TASK)
    assert "rollout.template_fallback=keep_history" in str(e.value)
    loose = ChatFormat(
        smol_tokenizer, template=shipped_template("qwen3.jinja"), fallback="keep_history"
    )
    assert require_token_safe(loose, CalculatorEnv(), TASK).mode == "keep_history"
    # without tools only the plain shapes are walked, headed by the env's own first messages
    plain = audit(chat, tools=[], prompt=CalculatorEnv().reset(options={"task": TASK})[0])
    assert plain.conversations == 4 and plain.mode == "exact"


def test_check_template_command(smol_path, capsys):
    from agentgrpo.cli import main

    assert main(["check-template", str(smol_path)]) == 0
    assert "mode: exact" in capsys.readouterr().out
    qwen3 = str(template_file("qwen3.jinja"))
    assert main(["check-template", str(smol_path), "--template", qwen3]) == 1
    assert "NOT token-safe" in capsys.readouterr().out
    assert (
        main(["check-template", str(smol_path), "--template", qwen3, "--fallback", "keep_history"])
        == 0
    )


def _with_specials(tokenizer, *tokens):
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tok


def test_a_template_that_cannot_render_tool_calls_is_refused_for_a_tool_env(smol_tokenizer):
    """DeepSeek-V3's template concatenates arguments as a string: given objects (its string form
    turned off here, as for a template that takes neither) every tool conversation raises, and it
    shows no tools at all, like Gemma 3's. With tools both would make every tool episode ENV_ERROR
    or useless, so the audit refuses; without tools they stay usable. With the JSON text that
    ChatFormat's probe finds it wants, only the missing tools remain (test_stepwise)."""
    eos = "<｜end▁of▁sentence｜>"
    deepseek = ChatFormat(
        _with_specials(smol_tokenizer, eos),
        template=shipped_template("deepseekv3.jinja"),
        end_of_turn=eos,
    )
    assert deepseek.string_arguments
    as_found = audit(deepseek)
    assert as_found.mode == "refuse" and kinds(as_found) >= {("no_tool_support", True)}
    assert ("render_error", True) not in kinds(as_found)
    deepseek.string_arguments = False
    report = audit(deepseek)
    assert report.mode == "refuse" and ("render_error", True) in kinds(report)
    assert ("no_tool_support", True) in kinds(report)
    assert "the template cannot render a tool conversation" in report.format()
    assert "as a JSON string either" in report.format()
    assert "max_tool_calls_per_turn" not in report.format()  # not only parallel calls fail
    assert audit(deepseek, tools=[]).mode == "exact"
    gemma = ChatFormat(
        _with_specials(smol_tokenizer, "<start_of_turn>", "<end_of_turn>"),
        template=shipped_template("gemma3.jinja"),
        end_of_turn="<end_of_turn>",
    )
    report = audit(gemma)
    assert report.mode == "refuse" and ("no_tool_support", True) in kinds(report)
    assert "does not show the tools" in report.format()
    assert audit(gemma, tools=[]).mode == "exact"
    with pytest.raises(TemplateError, match="not token-safe"):
        require_token_safe(gemma, CalculatorEnv(), TASK)


HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>"]
GLM = ["<|assistant|>", "<|system|>", "[gMASK]", "<sop>"]


@pytest.mark.parametrize(
    "name, specials, eots",
    [
        ("gptoss.jinja", HARMONY, ["<|call|>", "<|return|>"]),
        ("glm4moe.jinja", GLM, ["<|observation|>", "<|user|>"]),
    ],
)
def test_several_end_of_turn_tokens_and_a_turn_ending_at_the_next_role_token(
    smol_tokenizer, tmp_path, capsys, name, specials, eots
):
    """`--end-of-turn` may be repeated: GPT-OSS (<|call|>, <|return|>) and GLM-4.5 (whose turn ends
    where the <|observation|> or <|user|> of the next message starts) are refused as one sequence
    for the history they rewrite, and train step-wise (test_stepwise runs their episodes)."""
    from agentgrpo.cli import main

    tok = _with_specials(smol_tokenizer, *specials, *eots)
    template = shipped_template(name)
    single = audit_template(tok, template, parser="auto", end_of_turn=eots)
    assert single.mode == "refuse" and kinds(single) >= {("rewrites_history", True)}
    assert ("no_end_of_turn", True) not in kinds(single)
    assert single.end_of_turn == " or ".join(eots)
    auto = audit_template(tok, template, parser="auto", end_of_turn=eots, trajectory_mode="auto")
    assert auto.mode == "stepwise" and not [i for i in auto.issues if i.fatal], auto.format()
    assert auto.turn_end_opens_next == (name == "glm4moe.jinja")
    assert ("next message's role token" in auto.format()) == (name == "glm4moe.jinja")
    # GPT-OSS renders one call of a parallel turn: a warning with the advice that avoids it
    one_call = [i for i in auto.issues if i.why == ONE_CALL]
    assert [i.conversation for i in one_call] == (["parallel tool calls"] if "gpt" in name else [])
    assert ("max_tool_calls_per_turn=1" in auto.format()) == ("gpt" in name)
    assert "register a parser" not in auto.format()
    # the first token alone does not end every turn (an answer, a turn before a user message)
    one = audit_template(tok, template, parser="auto", end_of_turn=eots[0], trajectory_mode="auto")
    assert ("no_end_of_turn", True) in kinds(one)
    tok.save_pretrained(tmp_path)
    args = ["check-template", str(tmp_path), "--template", str(template_file(name))]
    args += [a for e in eots for a in ("--end-of-turn", e)]
    assert main([*args, "--trajectory-mode", "auto"]) == 0
    assert "mode: stepwise" in capsys.readouterr().out
    assert main(args) == 1
