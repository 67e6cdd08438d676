"""The template audit's findings: each issue found, and the report that groups them into a mode
(what agentgrpo will do with this template) and advice (what the user can change)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

IssueKind = Literal[
    "rewrites_history",
    "no_end_of_turn",
    "render_error",
    "retokenizes",
    "parser_mismatch",
    "generation_prompt",
    "end_of_turn",
    "no_tool_support",
]
Mode = Literal["exact", "keep_history", "stepwise", "refuse"]
ONE_CALL = "the template renders only the first of several tool calls in one turn"


@dataclass
class TemplateIssue:
    conversation: str
    turn: int  # the assistant turn (1-based) it concerns; 0 = the first prompt
    kind: IssueKind
    fatal: (
        bool  # fatal issues make the learner's tokens differ from the model's (or break rollouts)
    )
    why: str  # the cause, shared by all occurrences of one problem (the report groups by it)
    detail: str = ""  # this occurrence: where the text changed, what the template raised


@dataclass
class TemplateReport:
    template_source: str
    end_of_turn: str
    parser: str
    fallback: str
    conversations: int = 0
    turns: int = 0
    issues: list[TemplateIssue] = field(default_factory=list)
    fallback_works: bool = True  # keep_history located the new messages in every rewritten render
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    preserve_thinking_switch: bool = False  # the template has a `preserve_thinking` variable
    trajectory_mode: str = "single"  # the ChatFormat's (see agentgrpo.chat.format.TrajectoryMode)
    turn_end_opens_next: bool = False  # the turn ends at the next message's role token (GLM)
    new_segments: int = 0  # env turns after which the walk started a new segment

    @property
    def prefix_preserving(self) -> bool:
        return not any(i.kind == "rewrites_history" for i in self.issues)

    @property
    def mode(self) -> Mode:
        fatal = {i.kind for i in self.issues if i.fatal}
        if not fatal:
            return "stepwise" if self.new_segments else "exact"
        if (
            fatal == {"rewrites_history"}
            and self.fallback == "keep_history"
            and self.fallback_works
        ):
            return "keep_history"
        return "refuse"

    def advice(self) -> list[str]:
        out = []
        kinds = {i.kind for i in self.issues}
        if "rewrites_history" in kinds:
            if self.preserve_thinking_switch and not self.template_kwargs.get("preserve_thinking"):
                out.append(
                    "this template has a preserve_thinking switch: try "
                    "rollout.chat_template_kwargs={preserve_thinking: true} and audit again"
                )
            if self.trajectory_mode == "single" and self.fallback != "keep_history":
                out.append(
                    "train each rewritten turn as its own segment: "
                    "rollout.trajectory_mode=auto (every segment is token-exact; "
                    "docs/learner.md says how segments weigh)"
                )
            single = self.trajectory_mode == "single"
            if self.fallback != "keep_history" and self.fallback_works and single:
                out.append(
                    "choose rollout.template_fallback=keep_history: the model then keeps "
                    "seeing its earlier turns verbatim (unlike this template at inference), and "
                    "the learner trains on exactly those tokens"
                )
            elif not self.fallback_works:
                out.append("keep_history cannot locate the new messages in this template's output")
            if self.mode == "refuse":
                out.append(
                    "point model.chat_template at a template that keeps earlier turns verbatim"
                )
        if "no_end_of_turn" in kinds or "end_of_turn" in kinds:
            out.append(
                f"assistant turns must end with the token the model stops on ({self.end_of_turn!r} "
                "here): pass the model's end-of-turn token (--end-of-turn) or fix the template"
            )
        mismatches = [
            i.why for i in self.issues if i.kind == "parser_mismatch" and i.why != ONE_CALL
        ]
        if any(i.why == ONE_CALL for i in self.issues):
            out.append(
                "set rollout.max_tool_calls_per_turn=1: the template shows one call per turn, "
                "and a ToolEnv then runs only that one"
            )
        fits = sorted(
            {
                m.group(1)
                for w in mismatches
                for m in [re.search(r"parser (\w+) reads them", w)]
                if m
            }
        )
        if any("no tool support" in w for w in mismatches) or "no_tool_support" in kinds:
            out.append(
                "this template cannot show tool calls: use a tool-aware template "
                "(model.chat_template)"
            )
        elif fits:
            out.append(f"set model.tool_parser={fits[0]}")
        elif mismatches:
            out.append(
                "register a parser for this template's tool-call format "
                "(agentgrpo.chat.parsers.PARSERS)"
            )
        if "render_error" in kinds:
            out.append(
                "episodes of a shape the template cannot render end with ENV_ERROR (unscorable)"
            )
            if {i.conversation for i in self.issues if i.kind == "render_error"} == {
                "parallel tool calls"
            }:
                out.append(
                    "this template refuses several tool calls in one turn: set "
                    "rollout.max_tool_calls_per_turn=1; a ToolEnv then runs the first call, "
                    "answers the others with a too_many_calls error, and the chat template renders "
                    "only the call it ran (the model's tokens stay as sampled)"
                )
        return out

    def format(self) -> str:
        verdict = {
            "exact": "token-exact (prefix-preserving)",
            "keep_history": "not prefix-preserving; the explicit keep_history fallback is in use",
            "stepwise": f"step-wise: {self.new_segments} env turn(s) started a new segment "
            f"(trajectory_mode {self.trajectory_mode})",
            "refuse": "NOT token-safe: training refuses to start",
        }[self.mode]
        lines = [
            f"template: {self.template_source}; end of turn {self.end_of_turn!r}; "
            f"parser {self.parser}; "
            f"fallback {self.fallback}; trajectory mode {self.trajectory_mode}"
            + (f"; kwargs {self.template_kwargs}" if self.template_kwargs else ""),
            f"checked {self.conversations} conversations, {self.turns} assistant turns",
            *(
                ["the turn has no end token of its own: it ends at the next message's role token"]
                if self.turn_end_opens_next
                else []
            ),
            f"prefix-preserving: {'yes' if self.prefix_preserving else 'no'}",
            f"mode: {self.mode} - {verdict}",
        ]
        if self.template_source == "agentgrpo-hermes-chatml":
            lines.append(
                "note: the tokenizer's own template has no tool support; agentgrpo's Hermes-style "
                "ChatML template is used instead"
            )
        groups: dict[tuple[str, str], list[TemplateIssue]] = {}
        for i in self.issues:
            groups.setdefault((i.kind, i.why), []).append(i)
        for (kind, why), found in groups.items():
            first = found[0]
            label = (
                "fallback"
                if kind == "rewrites_history" and self.mode == "keep_history"
                else "segment"
                if kind == "rewrites_history" and not first.fatal
                else "FATAL"
                if first.fatal
                else "warn"
            )
            where = ", ".join(sorted({i.conversation for i in found}))
            lines.append(f"  [{label}] {kind}: {why}")
            lines.append(f"      {len(found)} turn(s) in: {where}")
            if first.detail:
                at = "the first prompt" if first.turn == 0 else f"after turn {first.turn}"
                lines.append(f"      e.g. {first.conversation!r}, {at}: {first.detail}")
        lines += [f"  advice: {a}" for a in self.advice()]
        return "\n".join(lines)
