"""Template audit: can agentgrpo continue conversations token-exactly with this chat template?

The rollout never re-tokenizes history: it appends the sampled ids and then the suffix the
template renders for the env's new messages (`ChatFormat.suffix_ids`), which is exact only when
the template is prefix-preserving. Some templates rewrite earlier turns (Qwen3 drops earlier
`<think>` blocks) and some cannot render a shape at all (Llama 3.1 refuses parallel calls).

`audit` replays synthetic conversations (`template_conversations.py`) turn by turn as the rollout
would, the template's own rendering of each assistant turn playing the sampled ids, and checks
the text, the end-of-turn token, the ids and the parser at every turn. The report's `mode` is
what agentgrpo will do: "exact", "keep_history", "stepwise" or "refuse".
`require_token_safe` is what training calls at start-up: it raises TemplateError with the report
when the mode is "refuse". `agentgrpo check-template MODEL_DIR` prints the report. What is fatal
and what is a warning: docs/chat.md, "The template audit".
"""

from __future__ import annotations

import copy
import difflib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentgrpo.chat.format import (
    PARSERS,
    ChatFormat,
    HistoryRewritten,
    TemplateError,
    TemplateFallback,
    TrajectoryMode,
)
from agentgrpo.chat.trajectory import TrajectoryBuilder
from agentgrpo.checks.template_conversations import SYNTHETIC_TOOL, conversations
from agentgrpo.checks.template_report import (
    ONE_CALL,
    IssueKind,
    Mode,
    TemplateIssue,
    TemplateReport,
)
from agentgrpo.env.base import Env, run_sync
from agentgrpo.types import Message, Task

__all__ = [
    "ONE_CALL",
    "SYNTHETIC_TOOL",
    "Mode",
    "TemplateIssue",
    "TemplateReport",
    "audit",
    "audit_template",
    "conversations",
    "require_token_safe",
]

# ---------------------------------------------------------------------------------------------
# The audit


def _diagnose(before: str, after: str, end_of_turn: str) -> tuple[str, str]:
    """(why, where): the first change `after` makes to `before`'s text, and a guess at its cause."""
    sm = difflib.SequenceMatcher(None, before, after, autojunk=False)
    _, i1, i2, j1, j2 = next(op for op in sm.get_opcodes() if op[0] != "equal")
    window = before[max(0, i1 - 12) : i2 + 12]  # the diff may cut a tag in two: look around it
    removed, added = before[i1:i2], after[j1:j2]
    if re.search(r"<think>\s*</think>", window):
        why = "it renders an empty <think></think> block in the last assistant turn only"
    elif "<think>" in window or "</think>" in window:
        why = "it drops the reasoning (<think>...</think>) of earlier assistant turns"
    elif before.count(end_of_turn) > after.count(end_of_turn):
        why = f"it puts {end_of_turn!r} only after the final turn"
    elif not removed.strip() and not added.strip():
        why = "it changes whitespace in earlier turns"
    else:
        why = "it renders an earlier turn differently once more messages follow"
    where = (
        f"at character {i1}, {before[max(0, i1 - 20) : i2 + 20]!r} becomes "
        f"{after[max(0, j1 - 20) : j2 + 20]!r}"
    )
    return why, where


def _calls(m: Message) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in m.tool_calls or []]


def _parser_issue(
    chat: ChatFormat,
    name: str,
    turn: int,
    text: str,
    want: list[tuple[str, dict]],
    tools: list[dict],
) -> TemplateIssue:
    if not all(n in text for n, _ in want):
        return TemplateIssue(
            name,
            turn,
            "parser_mismatch",
            True,
            "the template does not render tool calls (no tool support)",
            f"turn text {text[:80]!r}",
        )
    got = _calls(chat.parse(text, tools).message)
    if 0 < len(got) < len(want) and got == want[: len(got)]:  # GPT-OSS renders the first call
        return TemplateIssue(
            name, turn, "parser_mismatch", False, ONE_CALL, f"{text[:100]!r} -> {got}"
        )
    fits = [p for p, parse in PARSERS.items() if _calls(parse(text, tools).message) == want]
    why = f"parser {chat.parser_name} does not read the calls this template renders" + (
        f"; parser {fits[0]} reads them" if fits else ""
    )
    return TemplateIssue(
        name,
        turn,
        "parser_mismatch",
        False,
        why,
        f"{text[:100]!r} -> {_calls(chat.parse(text, tools).message)}",
    )


def _common_prefix(a: str, b: str) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _render_error(name: str, conv: list[Message], turn: int, e: TemplateError) -> TemplateIssue:
    """A conversation the template cannot render: fatal for tool conversations other than parallel
    tool calls (docs/chat.md, "The template audit")."""
    tool_shape = any(m.tool_calls or m.role == "tool" for m in conv)
    if not tool_shape:
        why = "the template cannot render this conversation shape"
    else:
        why = "the template cannot render a tool conversation"
        if "dict" in str(e) and "TypeError" in str(e):
            why += (
                " (it fails on tool-call arguments passed as a JSON object, and ChatFormat's probe "
                "did not find it rendering them as a JSON string either)"
            )
    return TemplateIssue(
        name, turn, "render_error", tool_shape and name != "parallel tool calls", why, str(e)
    )


def _walk(
    chat: ChatFormat,
    name: str,
    conv: list[Message],
    first: int,
    tools: list[dict] | None,
    report: TemplateReport,
) -> None:
    """Replay one conversation turn by turn as the rollout would (the first prompt renders
    `conv[:first]`), recording every issue: the template's own rendering of each assistant turn
    plays the sampled ids, and the trajectory builder continues after the env's messages."""
    try:
        ids = chat.prompt_ids(conv[:first], tools)
    except TemplateError as e:
        report.issues.append(
            TemplateIssue(
                name, 0, "render_error", True, "the template cannot render the first prompt", str(e)
            )
        )
        return
    replay = _Replay(chat, name, conv, first, tools, report)
    replay.tokens.open_segment(ids)
    i, turn = first, 0
    while i < len(conv):
        turn += 1
        report.turns += 1
        new = list(itertools.takewhile(lambda m: m.role != "assistant", conv[i + 1 :]))
        stop = replay.assistant_turn(conv[i], new, turn)
        i += 1 + len(new)
        if stop is None or (new and not replay.env_turn(new, turn, stop)):
            return


@dataclass
class _Replay:
    """One synthetic conversation in replay: the history so far, its token sequences (the
    rollout's trajectory builder) and whether those ids should still equal the template's
    rendering of the history tokenized in one piece (`exact`: False once they legitimately
    differ)."""

    chat: ChatFormat
    name: str
    conv: list[Message]
    first: int
    tools: list[dict] | None
    report: TemplateReport
    exact: bool = True

    def __post_init__(self) -> None:
        self.history = self.conv[: self.first]
        self.tokens = TrajectoryBuilder(self.chat)

    def issue(self, turn: int, kind: IssueKind, fatal: bool, why: str, detail: str = "") -> None:
        self.report.issues.append(TemplateIssue(self.name, turn, kind, fatal, why, detail))

    def assistant_turn(self, a: Message, new: list[Message], turn: int) -> str | None:
        """Play assistant turn `a` as sampled: the template's text of it, cut at the end-of-turn
        token the model stops on. Returns that token's text; None when the replay must stop."""
        chat, tools, history = self.chat, self.tools, self.history
        try:
            gen = chat.render(history, tools, add_generation_prompt=True)
            full = chat.render(history + [a], tools)
            alone = (
                None
                if full.startswith(gen)
                else _turn_alone(chat, self.conv[: self.first], a, tools)
            )
        except TemplateError as e:
            self.report.issues.append(_render_error(self.name, self.conv, turn, e))
            return None
        start = len(gen)
        if alone is not None:  # the template rendered history anew once the turn was added
            gen, full, start = alone  # (GPT-OSS drops a call's analysis once an answer follows)
            self.exact = False
        elif not full.startswith(gen):  # DeepSeek-V3 opens <think> in the generation prompt only
            start = _common_prefix(gen, full)
            self.issue(
                turn,
                "generation_prompt",
                False,
                f"the generation prompt ends with {gen[start:][:40]!r}, which the template "
                "does not render for assistant turns in history (harmless token-in/token-out; "
                "a server re-rendering text would show the model another history)",
            )
            self.exact = False
        text = full[start:]
        try:
            end, stop = _turn_end(chat, text, full, history + [a] + new, tools)
        except TemplateError as e:
            self.report.issues.append(_render_error(self.name, self.conv, turn, e))
            return None
        if end < 0:
            self.issue(
                turn,
                "no_end_of_turn",
                True,
                "the template does not end assistant turns with "
                + " or ".join(map(repr, chat.end_of_turns)),
                f"turn text {text[:80]!r}",
            )
            return None
        sampled = _sampled_ids(chat, full, start, end, stop)
        if tools and _calls(chat.parse_assistant(sampled, tools=tools).message) != _calls(a):
            self.report.issues.append(
                _parser_issue(chat, self.name, turn, text[:end], _calls(a), tools)
            )
        self.tokens.sampled(sampled, [0.0] * len(sampled))
        history.append(a)
        return stop

    def env_turn(self, new: list[Message], turn: int, stop: str) -> bool:
        """Continue after the env's messages `new` as the rollout would, reporting a rewrite of
        history (and, under "single", whether keep_history could continue it); False when the
        replay must stop."""
        chat, tools, history = self.chat, self.tools, self.history
        try:
            before = chat.render(history, tools)
            after = chat.render(history + new, tools, add_generation_prompt=True)
        except TemplateError as e:
            self.report.issues.append(_render_error(self.name, self.conv, turn, e))
            return False
        single = chat.trajectory_mode == "single"
        rewritten = not after.startswith(before)
        if rewritten:
            why, where = _diagnose(before, after, stop)
            self.issue(
                turn, "rewrites_history", single, why, f"adding {[m.role for m in new]}: {where}"
            )
        try:
            if single and rewritten:  # what keep_history, the fallback of "single", would do
                self.exact = False
                keep = copy.copy(chat)
                keep.fallback = "keep_history"
                end_id = self.tokens.token_ids[-1]
                self.tokens.append(keep.suffix_ids(history, new, tools, end_id=end_id))
            elif self.tokens.continue_with(history, new, tools):  # the rollout's rule
                self.report.new_segments += 1
                self.exact = True
        except TemplateError as e:
            self._cannot_continue(turn, new, e, keep_history=single and rewritten)
            return False
        history += new
        if self.exact and self.tokens.token_ids != (whole := chat.encode(after)):
            self.issue(
                turn,
                "retokenizes",
                False,
                "the same text tokenizes differently in one piece (a server re-rendering text "
                "would show the model other tokens)",
                f"first difference at token {_first_diff(self.tokens.token_ids, whole)}",
            )
            self.exact = False
        return True

    def _cannot_continue(
        self, turn: int, new: list[Message], e: TemplateError, *, keep_history: bool
    ) -> None:
        if keep_history:
            self.report.fallback_works = False
            why = "keep_history cannot continue this conversation"
        elif isinstance(e, HistoryRewritten):  # the text extends, the sampled stop token does not
            why = "the sampled end-of-turn token is not how the template opens the next messages"
        else:
            self.report.issues.append(_render_error(self.name, self.conv, turn, e))
            return
        single = self.chat.trajectory_mode == "single"
        self.issue(turn, "rewrites_history", keep_history or single, why, str(e))


def _sampled_ids(chat: ChatFormat, full: str, start: int, end: int, stop: str) -> list[int]:
    """The ids of the turn `full[start:]` up to its end-of-turn token `stop` (at `end` in it) as
    they stand in the conversation (a tokenizer may treat the start of its input differently,
    e.g. SentencePiece's "▁"), else as text on its own; where the turn ends at the next
    message's role token, that token, which the model stops on, follows."""
    stop_id = (
        [chat.end_of_turn_ids[chat.end_of_turns.index(stop)]] if chat.turn_end_opens_next else []
    )
    closed = start + end + (0 if chat.turn_end_opens_next else len(stop))
    in_place, head = chat.encode(full[:closed]), chat.encode(full[:start])
    return (
        in_place[len(head) :] if in_place[: len(head)] == head else chat.encode(full[start:closed])
    ) + stop_id


def _turn_alone(
    chat: ChatFormat, head: list[Message], a: Message, tools: list[dict] | None
) -> tuple[str, str, int] | None:
    """(generation prompt, render, where the turn starts) of `a` right after the conversation's
    head, when the template renders earlier turns anew once `a` follows them (so its text cannot
    be cut from the render of the whole history) but not there; else None."""
    gen = chat.render(head, tools, add_generation_prompt=True)
    full = chat.render(head + [a], tools)
    return (gen, full, len(gen)) if full.startswith(gen) else None


def _turn_end(
    chat: ChatFormat, text: str, full: str, upto: list[Message], tools: list[dict] | None
) -> tuple[int, str]:
    """(where the turn `text` ends, the end-of-turn token the model stops on), (-1, "") when it
    does not end. With several end-of-turn tokens the first in the text ends the turn. Where the
    turn ends at the next message's role token (`turn_end_opens_next`), the turn is all of `text`
    and the token is the one the render of `upto` (the conversation up to the env's messages after
    the turn, `full` being its render up to the turn) opens those messages with, the first
    end-of-turn token when nothing follows or the template rewrites the history then."""
    if not chat.turn_end_opens_next:
        found = [(text.find(e), e) for e in chat.end_of_turns if e in text]
        return min(found) if found else (-1, "")
    after = chat.render(upto, tools, add_generation_prompt=True)
    rest = after[len(full) :] if after.startswith(full) else ""
    return len(text), next((e for e in chat.end_of_turns if rest.startswith(e)), chat.end_of_turn)


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _check_tools_shown(
    chat: ChatFormat, head: list[Message], tools: list[dict], report: TemplateReport
) -> None:
    """Fatal `no_tool_support` when the first prompt renders the same with and without the tools."""
    try:
        shown = chat.render(head, tools, add_generation_prompt=True) != chat.render(
            head, None, add_generation_prompt=True
        )
    except TemplateError:
        return  # the walk reports the render error
    if not shown:
        what = (
            "DeepSeek-V3's own template ignores them: use the tool template SGLang publishes for "
            "serving it, shipped as deepseekv3_tools (model.chat_template: deepseekv3_tools; "
            "check-template --template deepseekv3_tools)"
            if chat.parser_name == "deepseek_v3"
            else "a tool template of the model's family lists them in the system message"
        )
        report.issues.append(
            TemplateIssue(
                "-",
                0,
                "no_tool_support",
                True,
                "the template does not show the tools to the model (its prompt is the same with "
                f"and without `tools`): give `model.chat_template` a template that renders them "
                f"({what})",
                f"tools {[t.get('function', {}).get('name') for t in tools]}",
            )
        )


def audit(
    chat: ChatFormat, *, tools: list[dict] | None = None, prompt: list[Message] | None = None
) -> TemplateReport:
    """Audit `chat`'s template on synthetic conversations (docs/chat.md, "The template audit").

    `tools`: the env's tool schemas; `[]` audits only conversations without tools, None uses a
    synthetic calculator tool. `prompt`: the env's first messages, used as every conversation's
    head.
    """
    report = TemplateReport(
        template_source=chat.template_source,
        end_of_turn=" or ".join(chat.end_of_turns),
        parser=chat.parser_name,
        fallback=chat.fallback,
        template_kwargs=dict(chat.template_kwargs),
        trajectory_mode=chat.trajectory_mode,
        turn_end_opens_next=chat.turn_end_opens_next,
        preserve_thinking_switch="preserve_thinking" in (chat.template or ""),
    )
    render_tools = [SYNTHETIC_TOOL] if tools is None else (tools or None)
    # every render of the audit also checks ChatFormat's fast render path against transformers'
    checks, chat._fast_checks_left = chat._fast_checks_left, 1 << 30
    try:
        plans = conversations(tools, prompt)
        if render_tools:
            _check_tools_shown(chat, plans[0][1][: plans[0][2]], render_tools, report)
        for name, conv, first in plans:
            report.conversations += 1
            _walk(chat, name, conv, first, render_tools, report)
    finally:
        chat._fast_checks_left = min(checks, chat._fast_checks_left)
    return report


def audit_template(
    tokenizer: Any,
    template: str | None = None,
    *,
    parser: str = "hermes",
    end_of_turn: str | Sequence[str] | None = None,
    fallback: TemplateFallback = "none",
    template_kwargs: dict[str, Any] | None = None,
    trajectory_mode: TrajectoryMode = "single",
) -> TemplateReport:
    """Audit a tokenizer's chat template (or `template`) with and without tools.

    An end-of-turn token that the tokenizer does not have is reported, not raised.
    """
    try:
        chat = ChatFormat(
            tokenizer,
            template=template,
            parser=parser,
            end_of_turn=end_of_turn,
            fallback=fallback,
            template_kwargs=template_kwargs,
            trajectory_mode=trajectory_mode,
        )
    except ValueError as e:
        report = TemplateReport(
            template_source="config" if template else "tokenizer",
            end_of_turn=" or ".join(
                [end_of_turn] if isinstance(end_of_turn, str) else end_of_turn or []
            )
            or str(tokenizer.eos_token),
            parser=parser,
            fallback=fallback,
        )
        report.issues.append(
            TemplateIssue(
                "-",
                0,
                "end_of_turn",
                True,
                "the end-of-turn token is not a token of this tokenizer",
                str(e),
            )
        )
        return report
    return audit(chat)


def require_token_safe(chat: ChatFormat, env: Env, task: Task, *, seed: int = 0) -> TemplateReport:
    """Start-up check of training and evaluation: audit the template for this env's conversation
    shape (its first messages for `task`, its tools or none) and raise TemplateError with the report
    when rollouts would not be token-safe, unless the fallback or the trajectory mode chosen in the
    config makes them so.

    `env` is a probe instance (reset once here, then discarded). Returns the report; its `mode`
    is worth printing with the effective config.
    """
    prompt, _ = run_sync(env.reset(seed=seed, options={"task": task}))
    report = audit(chat, tools=list(env.tool_schemas()), prompt=list(prompt))
    if report.mode == "refuse":
        raise TemplateError(
            "the chat template is not token-safe for this environment:\n" + report.format()
        )
    return report
