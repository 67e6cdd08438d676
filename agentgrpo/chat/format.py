"""The only boundary between text and tokens (token-in, token-out).

Everything the learner trains on is a list of ids the engine received or sampled; this module
turns messages into ids and sampled ids into messages:

- `ChatFormat.prompt_ids(messages, tools)`: the first prompt, rendered by the chat template.
- Sampled ids are never re-tokenized: the rollout appends them verbatim and `parse_assistant`
  only decodes them to read the tool calls.
- `ChatFormat.suffix_ids(history, new_messages, tools)`: the ids after the model's end-of-turn
  token, the difference between two renders; a template that rewrites the history raises
  `HistoryRewritten` rather than a guess.
- Message content is data, never control: special-token text inside it is tokenized as plain
  text (`held.py`), so an env cannot forge a turn boundary. The rules in full: docs/chat.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jinja2

from agentgrpo.chat.errors import HistoryRewritten, TemplateError
from agentgrpo.chat.held import (
    _common_prefix,
    _Placeholders,
    hold,
    printed,
    special_tokens,
    split_at_specials,
)
from agentgrpo.chat.keep_history import _last_of, suffix_after_last_turn
from agentgrpo.chat.parsers import (
    PARSERS,
    ParsedTurn,
    ParseError,
    detect_parser,
    get_parser,
    parse_hermes,
    parse_llama3_json,
)
from agentgrpo.chat.probes import (
    detected_end_of_turns,
    turn_end_opens_next,
    wants_string_arguments,
)
from agentgrpo.chat.template import (
    FAST_RENDER_CHECKS,
    HERMES_CHATML_TEMPLATE,
    _compiled_renderer,
    template_supports_tools,
)
from agentgrpo.types import Message

__all__ = [
    "HERMES_CHATML_TEMPLATE",
    "PARSERS",
    "ChatFormat",
    "HistoryRewritten",
    "ParseError",
    "ParsedTurn",
    "TemplateError",
    "TemplateFallback",
    "TrajectoryMode",
    "detect_parser",
    "get_parser",
    "parse_hermes",
    "parse_llama3_json",
    "template_supports_tools",
]

TemplateFallback = Literal["none", "keep_history"]
TrajectoryMode = Literal["single", "auto", "stepwise"]
TRAJECTORY_MODES = ("single", "auto", "stepwise")
TRUNCATION_MARKER = "\n[... {omitted} more {unit} truncated]"


def truncation_note(marker: str, omitted: int, unit: str) -> str:
    """`marker` with `{omitted}` and `{unit}` ("tokens", "bytes") filled in; any other braces are
    plain text, not a format string."""
    return marker.replace("{omitted}", str(omitted)).replace("{unit}", unit)


def _utf8(text: str) -> str:
    """`text` if it can be UTF-8 encoded; otherwise with each lone UTF-16 surrogate replaced by
    U+FFFD (a surrogate pair split into two code points is joined into its character). Tokenizers
    raise on such text; agentgrpo replaces it rather than crash an episode on a model-written
    escape like "\\ud83d"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


# ---------------------------------------------------------------------------------------------
# Rendering


class ChatFormat:
    """A tokenizer plus chat template plus tool-call parser: everything text<->token.

    Args:
        tokenizer: a transformers tokenizer.
        template: a Jinja chat template overriding the tokenizer's. By default the tokenizer's own
            template is used when it supports tools; otherwise `HERMES_CHATML_TEMPLATE` (this
            choice is recorded in `self.template_source`).
        parser: name of the tool-call parser in `PARSERS`, or "auto" (default): the parser for the
            format the template renders (`detect_parser`), Hermes where it shows none it knows.
            `self.parser_name` is the parser chosen.
        end_of_turn: the token that ends an assistant turn, or several (GPT-OSS: `<|call|>`,
            `<|return|>`); default the ones the template renders (`detected_end_of_turns`), else
            the tokenizer's EOS token. All are stop tokens; `self.end_of_turn` is the first.
            Where the next message's role token ends a turn (GLM-4.5), those role tokens are the
            end-of-turn tokens (`self.turn_end_opens_next`; docs/chat.md).
        fallback: what `suffix_ids` does when the template rewrites earlier turns. "none" (default)
            raises TemplateError. "keep_history" continues the tokens the model saw, earlier turns
            verbatim: a train/inference difference in context, so it must be chosen explicitly.
        template_kwargs: extra variables for the template (e.g. `{"preserve_thinking": True}` for
            templates that have such a switch, `{"enable_thinking": False}`).
        trajectory_mode: what the rollout does when the history is rewritten (`HistoryRewritten`):
            "single" (default) ends the episode (or keep_history continues it), "auto" starts a
            new segment then, "stepwise" starts one at every turn. Not with keep_history: the two
            are different answers to the same problem.

    Example (a tool turn; the sampled ids stand in for an engine's `Completion.token_ids`):
        >>> from agentgrpo.chat.format import ChatFormat
        >>> from agentgrpo.env.tool import tool
        >>> from agentgrpo.models.embedded import default_model_path, load_tokenizer
        >>> from agentgrpo.types import Message
        >>> chat = ChatFormat(load_tokenizer(default_model_path()))
        >>> @tool
        ... def add(a: int, b: int) -> int:
        ...     '''Add two integers.'''
        ...     return a + b
        >>> history, tools = [Message(role="user", content="2+2?")], [add.schema]
        >>> ids = chat.prompt_ids(history, tools)
        >>> sampled_ids = chat.encode(
        ...     '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call><|im_end|>'
        ... )
        >>> turn = chat.parse_assistant(sampled_ids, tools=tools)  # the message + malformed calls
        >>> turn.message.tool_calls, turn.errors
        ([ToolCall(id='call_...', name='add', arguments={'a': 2, 'b': 2})], [])
        >>> call = turn.message.tool_calls[0]
        >>> history += [turn.message]
        >>> result = Message(role="tool", content="4", tool_call_id=call.id, name=call.name)
        >>> suffix = chat.suffix_ids(history, [result], tools)  # after the sampled <|im_end|>
        >>> print(chat.decode(suffix), end="")
        <BLANKLINE>
        <|im_start|>tool
        4<|im_end|>
        <|im_start|>assistant
        >>> ids += sampled_ids + suffix  # the next prompt: the sampled ids kept as they are
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        template: str | None = None,
        parser: str = "auto",
        end_of_turn: str | Sequence[str] | None = None,
        fallback: TemplateFallback = "none",
        template_kwargs: dict[str, Any] | None = None,
        trajectory_mode: TrajectoryMode = "single",
    ) -> None:
        self.tokenizer = tokenizer
        if template is not None:
            self.template, self.template_source = template, "config"
        elif template_supports_tools(getattr(tokenizer, "chat_template", None)):
            self.template, self.template_source = tokenizer.chat_template, "tokenizer"
        else:
            self.template, self.template_source = HERMES_CHATML_TEMPLATE, "agentgrpo-hermes-chatml"
        if parser == "auto":
            parser = detect_parser(self.template) or "hermes"
        self.parse = get_parser(parser)
        self.parser_name = parser
        if fallback not in ("none", "keep_history"):
            raise ValueError(f"fallback must be 'none' or 'keep_history', got {fallback!r}")
        self.fallback: TemplateFallback = fallback
        if trajectory_mode not in TRAJECTORY_MODES:
            raise ValueError(
                f"trajectory_mode must be one of {list(TRAJECTORY_MODES)}, got {trajectory_mode!r}"
            )
        if fallback == "keep_history" and trajectory_mode != "single":
            raise ValueError(
                "template_fallback=keep_history with trajectory_mode="
                f"{trajectory_mode}: choose one (keep_history continues one "
                "sequence, segments re-render it)"
            )
        self.trajectory_mode: TrajectoryMode = trajectory_mode
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self._fast = _compiled_renderer(self.template, tokenizer, self.template_kwargs)
        self._fast_checks_left = FAST_RENDER_CHECKS
        self._special_text, self._strips = special_tokens(tokenizer)
        self.string_arguments = wants_string_arguments(self.template, self._render_dicts)
        self._set_end_of_turns(end_of_turn)
        self.turn_end_opens_next = turn_end_opens_next(self._render_dicts, self.end_of_turns)

    def _set_end_of_turns(self, end_of_turn: str | Sequence[str] | None) -> None:
        """`end_of_turns`, their ids and the stop ids: `end_of_turn` where given, else the tokens
        the template ends an assistant turn with (`detected_end_of_turns`), else the EOS token."""
        tokenizer = self.tokenizer
        eots = [end_of_turn] if isinstance(end_of_turn, str) else list(end_of_turn or [])
        eots = (
            eots
            or detected_end_of_turns(self._render_dicts, self._template_dict, self._special_text)
            or [tokenizer.eos_token]
        )
        if None in eots or not all(eots):
            raise ValueError("the tokenizer has no EOS token: pass end_of_turn= explicitly")
        eot_ids = []
        for eot in eots:
            (eot_id,) = tokenizer.convert_tokens_to_ids([eot]) or [None]
            if eot_id is None or eot_id == tokenizer.unk_token_id:
                raise ValueError(
                    f"end-of-turn token {eot!r} is not a single token of this tokenizer"
                )
            eot_ids.append(eot_id)
        self.end_of_turns: tuple[str, ...] = tuple(eots)
        self.end_of_turn_ids: tuple[int, ...] = tuple(eot_ids)
        self.end_of_turn, self.end_of_turn_id = eots[0], eot_ids[0]
        stops = set(self.end_of_turn_ids)
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))

    # -- rendering ----------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Message],
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = False,
    ) -> str:
        """The template's text for `messages`, exactly as
        `tokenizer.apply_chat_template` renders it.

        Raises TemplateError when the template refuses the conversation (e.g. Llama 3.1's "only
        supports single tool-calls"). The compiled template is called directly when possible: it
        is ~3x cheaper than `apply_chat_template`, whose input normalisation is the identity on the
        plain dicts built here; the first renders are compared with `apply_chat_template` and any
        difference switches the shortcut off for good.
        """
        return self._render_dicts(
            [self._template_dict(m) for m in messages], tools, add_generation_prompt
        )

    def _render_dicts(
        self, dicts: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool
    ) -> str:
        try:
            if self._fast is None:
                return self._render_public(dicts, tools, add_generation_prompt)
            out = self._fast(dicts, tools or None, add_generation_prompt)
            if self._fast_checks_left > 0:
                self._fast_checks_left -= 1
                public = self._render_public(dicts, tools, add_generation_prompt)
                if out != public:
                    self._fast = None
                    return public
            return out
        except (jinja2.TemplateError, TypeError) as e:  # template code is model-supplied: report it
            raise TemplateError(
                f"the chat template cannot render {[d['role'] for d in dicts]}: "
                f"{type(e).__name__}: {e}"
            ) from e

    def _render_public(
        self, dicts: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool
    ) -> str:
        return self.tokenizer.apply_chat_template(
            dicts,
            tools=tools or None,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def _template_dict(self, m: Message, max_tool_calls: int | None = None) -> dict[str, Any]:
        """`m` as the template reads it. Tool-call arguments are an object, as most templates
        expect (Qwen2.5 double-encodes strings), or their JSON text where the template wants a
        string (`string_arguments`, DeepSeek-V3), so the rendered call reads as the model wrote
        it (JSON, non-ASCII kept as it is)."""
        d = m.to_dict()
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {
                        "name": tc.name,
                        "arguments": json.dumps(tc.arguments, ensure_ascii=False)
                        if self.string_arguments
                        else tc.arguments,
                    },
                }
                for tc in m.tool_calls[:max_tool_calls]
            ]
        return d

    def encode(self, text: str) -> list[int]:
        """Tokenize template output. Special tokens appear in the text, so none are added.

        Text that cannot be UTF-8 encoded (lone UTF-16 surrogates, e.g. a model-written JSON escape
        "\\ud83d" that a tool echoes) is tokenized with each lone surrogate replaced by U+FFFD
        (`_utf8`) instead of raising: the model sees the replacement character, and the ids stay
        what it saw."""
        return self.tokenizer.encode(_utf8(text), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(
        self,
        messages: Sequence[Message],
        tools: list[dict] | None = None,
        *,
        max_tool_calls: int | None = None,
    ) -> list[int]:
        """Ids of the prompt that asks for the next assistant turn after `messages`: the first
        prompt, and a new segment's (its assistant turns rendered with at most `max_tool_calls`
        calls, as in `suffix_ids`)."""
        dicts = [self._template_dict(m, max_tool_calls) for m in messages]
        text, protected = self._render_protected([], dicts, tools, True)
        return self._encode_rendered(text, protected)

    def _render_protected(
        self,
        fixed: list[dict[str, Any]],
        dicts: list[dict[str, Any]],
        tools: list[dict] | None,
        add_generation_prompt: bool,
    ) -> tuple[str, _Placeholders]:
        """The render of `fixed + dicts` with the special-token texts in `dicts`' contents and in
        `tools` held (`_hold`), and what was held. When something is held, the template's render of
        the real content is computed too: the placeholders avoid its text, and `_Held.check`
        requires the held render with the texts put back to equal it."""
        if self._special_text is None or not any(
            map(self._special_text.search, printed(dicts, tools))
        ):
            text = self._render_dicts(fixed + dicts, tools, add_generation_prompt)
            return text, _Placeholders(dicts, tools)
        real = self._render_dicts(fixed + dicts, tools, add_generation_prompt)
        protected = self._hold(dicts, tools, avoid=real)
        text = self._render_dicts(fixed + protected.dicts, protected.tools, add_generation_prompt)
        protected.check(text, real)
        return text, protected

    def _hold(
        self, dicts: list[dict[str, Any]], tools: list[dict] | None = None, avoid: str = ""
    ) -> _Placeholders:
        """`dicts` and `tools` with this tokenizer's special-token texts held (`held.hold`)."""
        return hold(self._special_text, dicts, tools, avoid)

    def _encode_rendered(self, text: str, protected: _Placeholders) -> list[int]:
        """Tokenize template output rendered from `protected.dicts`: the held special texts go where
        their placeholders are, as plain text (`held.split_at_specials`). The ids are what the
        model sees."""
        if protected.pattern is None:
            return self.encode(text)
        ids: list[int] = []
        for piece, special in split_at_specials(text, self._special_text, self._strips):
            ids += self._encode_plain(protected.restore(piece))
            if special is not None:
                ids.append(self.tokenizer.convert_tokens_to_ids(special))
        return ids

    def _encode_after_end_of_turn(
        self, text: str, protected: _Placeholders, eot: str | None = None
    ) -> list[int]:
        """Ids of `text` as the tokenizer reads it right after the end-of-turn token: tokenized
        behind that token, whose id is dropped. Tokenizers split added tokens out first, so this is
        how the whole conversation tokenizes in one piece (an rstrip token absorbs whitespace, as
        there). `text` alone is not, for a tokenizer that prepends "▁" to its input (Metaspace,
        `prepend_scheme="first"`): every suffix began with a "▁" the template never rendered."""
        eot = eot or self.end_of_turn
        ids = self._encode_rendered(eot + text, protected)
        if not ids or ids[0] != self.end_of_turn_ids[self.end_of_turns.index(eot)]:
            raise TemplateError(
                f"the tokenizer does not read {eot!r} as one token at the start "
                f"of {eot + text[:40]!r}; cannot continue after the sampled turn"
            )
        return ids[1:]

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        return self.tokenizer.encode(
            _utf8(text), add_special_tokens=False, split_special_tokens=True
        )

    def suffix_ids(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        tools: list[dict] | None = None,
        *,
        max_tool_calls: int | None = None,
        end_id: int | None = None,
    ) -> list[int]:
        """Ids to append after the model's end-of-turn token so that the sequence continues as
        `render(history + new_messages, add_generation_prompt=True)` would.

        `history` must end with the assistant message whose sampled ids end with an end-of-turn
        token. Raises HistoryRewritten (a TemplateError) when the template rewrites earlier turns
        (not prefix-preserving, unless `fallback="keep_history"`), TemplateError when it refuses
        the conversation or renders the assistant turn without an end-of-turn token.

        With several end-of-turn tokens the suffix follows the last one the template renders in
        the history (GPT-OSS: `<|call|>` after a call; an answer's `<|return|>` becomes `<|end|>`
        once more messages follow, which is a rewrite). Where the turn ends at the next message's
        role token (`turn_end_opens_next`, GLM-4.5), `end_id`, the id the model stopped on (default
        `end_of_turn_id`), is the first token of the new messages' render: the suffix is what
        follows it, never that token again. When the template opens them with another token than
        the one sampled (a call answered by `<|user|>`), the sampled ids cannot go on as rendered:
        HistoryRewritten, so "auto" starts a new segment.

        `max_tool_calls`: assistant messages of `history` are rendered with at most this many of
        their tool calls, the ones the env ran (a `ToolEnv` answers the rest with a too-many-calls
        error). The rendering only locates the suffix, which starts after the end-of-turn token; the
        assistant turns themselves stay the sampled ids. So a template without parallel calls
        (Llama 3.1 refuses two in one turn) can continue a turn in which the model made several,
        once the env runs one per turn.
        """
        if not history or history[-1].role != "assistant":
            raise ValueError("suffix_ids: history must end with the assistant message just sampled")
        history_dicts = [
            self._template_dict(m, max_tool_calls) for m in history
        ]  # built once for both renders
        after, protected = self._render_protected(
            history_dicts, [self._template_dict(m) for m in new_messages], tools, True
        )
        before = self._render_dicts(history_dicts, protected.tools, False)  # tools held alike
        if self.turn_end_opens_next:  # the sampled stop token opens the next message
            eot = self.tokenizer.convert_ids_to_tokens(
                self.end_of_turn_id if end_id is None else end_id
            )
            glue, rest = "", after[len(before) :]
            if after.startswith(before) and eot in self.end_of_turns and rest.startswith(eot):
                return self._encode_after_end_of_turn(rest[len(eot) :], protected, eot)
        else:
            cut, eot = _last_of(before, self.end_of_turns)
            if cut < 0:
                raise TemplateError(
                    "the chat template renders the assistant turn without "
                    f"{' or '.join(map(repr, self.end_of_turns))}; cannot align the suffix "
                    "with the sampled end-of-turn token"
                )
            glue = before[cut + len(eot) :]
            if after.startswith(before):
                return self._encode_after_end_of_turn(glue + after[len(before) :], protected, eot)
        if self.fallback == "keep_history":
            tail, found = suffix_after_last_turn(
                self._render_dicts,
                self.end_of_turns,
                history_dicts,
                protected.dicts,
                protected.tools,
                after,
                glue,
            )
            if not self.turn_end_opens_next or found == eot:
                return self._encode_after_end_of_turn(tail, protected, found)
        raise _rewritten(before, after, eot, [m.role for m in new_messages])

    def truncate(
        self, text: str, max_tokens: int, marker: str = TRUNCATION_MARKER
    ) -> tuple[str, int]:
        """Cut `text` to its first `max_tokens` tokens plus `marker` (`{omitted}` is replaced by
        the number of tokens dropped, `{unit}` by "tokens"; `truncation_note`).
        Returns (text, tokens omitted). Used on tool output before it is rendered, so the model
        sees that the output was cut rather than a silent end. Lone surrogates come back replaced
        by U+FFFD (see `encode`)."""
        text = _utf8(text)
        if len(text.encode("utf-8")) <= max_tokens:  # a token covers at least one byte
            return text, 0
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text, 0
        kept = self.tokenizer.decode(ids[:max_tokens], skip_special_tokens=False).rstrip("\ufffd")
        omitted = len(ids) - max_tokens
        return kept + truncation_note(marker, omitted, "tokens"), omitted

    # -- parsing ------------------------------------------------------------------------------

    def parse_assistant(
        self,
        sampled_ids: Sequence[int],
        *,
        parse_tools: bool = True,
        tools: Sequence[Mapping] | None = None,
    ) -> ParsedTurn:
        """Turn one assistant turn's sampled ids into a Message (and malformed calls).

        Decoding is for reading only: the ids themselves are what the trajectory keeps. With
        `parse_tools=False` (an env without tools) the whole text is the content: tool-call syntax
        means nothing there, and the env should judge exactly what the model wrote. `tools`: the
        tool schemas the prompt was rendered with; the XML parsers (`qwen3_xml`, `glm4`) type
        argument values by them (without them every value stays a string).
        """
        ids = list(sampled_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        if not parse_tools:
            return ParsedTurn(Message(role="assistant", content=self.decode(ids).strip()))
        return self.parse(self.decode(ids), tools)


def _rewritten(before: str, after: str, eot: str, roles: list[str]) -> HistoryRewritten:
    """Why the sampled tokens cannot go on as the template renders history (`before`) followed
    by new messages of `roles` (`after`): another token opens them than the one the model stopped
    on, or the history's text changed."""
    if after.startswith(before):  # only where the turn ends at the next role token
        return HistoryRewritten(
            f"the model ended its turn with {eot!r}, but the chat template starts "
            f"{roles} messages with {after[len(before) :][:40]!r}: "
            "the sampled tokens cannot be continued as this template renders the "
            "conversation (rollout.trajectory_mode=auto trains the next turn as a new segment)"
        )
    at = _common_prefix(before, after)
    return HistoryRewritten(
        "the chat template is not prefix-preserving: adding "
        f"{roles} messages changes earlier text at character {at} "
        f"(before: {before[max(0, at - 40) : at + 40]!r}, "
        f"after: {after[max(0, at - 40) : at + 40]!r}). "
        "The tokens the model saw cannot be continued the way this template renders the "
        "conversation. Use a template that keeps earlier turns verbatim "
        "(or its own switch, e.g. "
        "chat_template_kwargs={preserve_thinking: true}), train the turns as segments "
        "(rollout.trajectory_mode=auto), or choose the explicit fallback "
        "rollout.template_fallback=keep_history. `agentgrpo check-template MODEL_DIR` shows "
        "which turns break and why."
    )
