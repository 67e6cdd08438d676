"""The only boundary between text and tokens (token-in, token-out).

Everything the learner trains on is a list of token ids that the engine either received or
sampled. This module is the one place that turns messages into ids and sampled ids into messages:

- `ChatFormat.prompt_ids(messages, tools)`: the first prompt, rendered by the chat template.
- Sampled ids are never re-tokenized: the rollout appends them verbatim (EOS included) and only
  *decodes* them here to parse tool calls (`parse_assistant`).
- `ChatFormat.suffix_ids(history, new_messages, tools)`: the tokens that follow the model's
  end-of-turn token when env/tool messages arrive. They are computed by rendering the whole
  conversation with and without the new messages and taking the difference, aligned right after
  the end-of-turn token (the template's own glue after it, e.g. ChatML's "\\n", belongs to the
  suffix and carries loss mask 0). Before using a suffix we check that the template is
  prefix-preserving for this conversation (`render(history + new)` starts with `render(history)`);
  if it is not (Qwen3 strips earlier `<think>` blocks when a user turn arrives) we raise
  `TemplateError` instead of guessing, unless the user chose the explicit `keep_history` fallback
  (see `ChatFormat`). `agentgrpo.template_audit` checks a template on many synthetic conversations
  before training starts (`require_token_safe`, `agentgrpo check-template`).
- `ChatFormat.truncate(text, max_tokens)`: tool output cut to a token budget, with a marker.
- Message content is data, never control: a special token's text inside a message (a tool printing
  `<|im_end|>\n<|im_start|>assistant`, a task copied from a chat log) is tokenized as plain text,
  so an environment cannot forge a turn boundary or an EOS. Only the template's own text and the
  model's samples carry special tokens (see `_encode_rendered`).

Templates without tool support (SmolLM2 ships plain ChatML) get `HERMES_CHATML_TEMPLATE`, a
Hermes-style tool-aware ChatML template: tools are described in the system message, calls are
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results come back in a `tool` turn.

Tool-call parsers are pluggable (`PARSERS`, in `agentgrpo.parsers`, re-exported here); a parser
never raises on model output: malformed calls come back as `ParseError`s that the rollout turns into
error tool messages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import jinja2

from agentgrpo.parsers import (
    PARSERS,
    ParsedTurn,
    ParseError,
    get_parser,
    parse_hermes,
    parse_llama3_json,
)
from agentgrpo.types import Message

__all__ = [
    "HERMES_CHATML_TEMPLATE", "PARSERS", "ChatFormat", "ParseError", "ParsedTurn", "TemplateError",
    "TemplateFallback", "get_parser", "parse_hermes", "parse_llama3_json", "template_supports_tools",
]

TemplateFallback = Literal["none", "keep_history"]
TRUNCATION_MARKER = "\n[... {omitted} more tokens truncated]"

HERMES_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou can call these functions. Their signatures are inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object inside <tool_call></tool_call> tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for tc in message.get('tool_calls') or [] %}"
    "{%- if (message['content'] or '') or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc['function']['name'] + '\", \"arguments\": ' }}"
    "{%- if tc['function']['arguments'] is string %}{{- tc['function']['arguments'] }}"
    "{%- else %}{{- tc['function']['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


FAST_RENDER_CHECKS = 64  # renders per ChatFormat compared with apply_chat_template (see render)


def _compiled_renderer(template: str, tokenizer: Any, template_kwargs: dict[str, Any]) -> Any:
    """`render(dicts, tools, add_generation_prompt) -> str` calling transformers' cached compiled
    template with the variables `apply_chat_template` passes, or None when that private helper is
    not available (then the public path is used)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template)
    except (ImportError, AttributeError, jinja2.TemplateError):  # private API or a broken template
        return None
    variables = {**tokenizer.special_tokens_map, **template_kwargs}

    def render(dicts: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return compiled.render(messages=dicts, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)

    return render


class TemplateError(ValueError):
    """The chat template cannot produce token-exact multi-turn rollouts for this conversation."""


# ---------------------------------------------------------------------------------------------
# Rendering


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and "tool_call" in template


class ChatFormat:
    """A tokenizer plus chat template plus tool-call parser: everything text<->token.

    Args:
        tokenizer: a transformers tokenizer.
        template: a Jinja chat template overriding the tokenizer's. By default the tokenizer's own
            template is used when it supports tools; otherwise `HERMES_CHATML_TEMPLATE` (this
            choice is recorded in `self.template_source`).
        parser: name of the tool-call parser in `PARSERS`.
        end_of_turn: the token that ends an assistant turn; default the tokenizer's EOS token.
        fallback: what `suffix_ids` does when the template rewrites earlier turns. "none" (default)
            raises TemplateError. "keep_history" continues the token sequence the model actually
            saw: the suffix is the template's rendering of the new messages (located after the last
            assistant turn's end-of-turn token), and earlier turns stay verbatim, so the model keeps
            seeing e.g. its earlier `<think>` blocks that this template would drop at inference.
            The learner still trains only on tokens the model saw; the cost is a train/inference
            difference in context, which is why it must be chosen explicitly.
        template_kwargs: extra variables for the template (e.g. `{"preserve_thinking": True}` for
            templates that have such a switch, `{"enable_thinking": False}`).

    Example:
        >>> chat = ChatFormat(tokenizer)
        >>> ids = chat.prompt_ids([Message(role="user", content="2+2?")], tools=[add.schema])
        >>> turn = chat.parse_assistant(sampled_ids)        # Message + malformed calls
        >>> ids += sampled_ids + chat.suffix_ids(history, tool_messages, tools)
    """

    def __init__(self, tokenizer: Any, *, template: str | None = None, parser: str = "hermes",
                 end_of_turn: str | None = None, fallback: TemplateFallback = "none",
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        if template is not None:
            self.template, self.template_source = template, "config"
        elif template_supports_tools(getattr(tokenizer, "chat_template", None)):
            self.template, self.template_source = tokenizer.chat_template, "tokenizer"
        else:
            self.template, self.template_source = HERMES_CHATML_TEMPLATE, "agentgrpo-hermes-chatml"
        self.parse = get_parser(parser)
        self.parser_name = parser
        if fallback not in ("none", "keep_history"):
            raise ValueError(f"fallback must be 'none' or 'keep_history', got {fallback!r}")
        self.fallback: TemplateFallback = fallback
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        eot = end_of_turn or tokenizer.eos_token
        if eot is None:
            raise ValueError("the tokenizer has no EOS token: pass end_of_turn= explicitly")
        eot_ids = tokenizer.convert_tokens_to_ids([eot])
        if not eot_ids or eot_ids[0] is None or eot_ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"end-of-turn token {eot!r} is not a single token of this tokenizer")
        self._fast = _compiled_renderer(self.template, tokenizer, self.template_kwargs)
        self._fast_checks_left = FAST_RENDER_CHECKS
        self.end_of_turn = eot
        self.end_of_turn_id: int = eot_ids[0]
        stops = {self.end_of_turn_id}
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = {t.content for t in decoder.values() if getattr(t, "special", False)}
        specials = {t for t in specials | set(getattr(tokenizer, "all_special_tokens", []) or []) if t}
        # One alternation: ~4 us on 4 KB against Llama 3's 256 special tokens (`any(t in s)`: ~140 us).
        self._special_text = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) \
            if specials else None

    # -- rendering ----------------------------------------------------------------------------

    def render(self, messages: Sequence[Message], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        """The template's text for `messages`, exactly as `tokenizer.apply_chat_template` renders it.

        Raises TemplateError when the template refuses the conversation (e.g. Llama 3.1's "only
        supports single tool-calls"). The compiled template is called directly when possible: it
        is ~3x cheaper than `apply_chat_template`, whose input normalisation is the identity on the
        plain dicts built here; the first renders are compared with `apply_chat_template` and any
        difference switches the shortcut off for good.
        """
        return self._render_dicts([self._template_dict(m) for m in messages], tools, add_generation_prompt)

    def _render_dicts(self, dicts: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
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
            raise TemplateError(f"the chat template cannot render {[d['role'] for d in dicts]}: "
                                f"{type(e).__name__}: {e}") from e

    def _render_public(self, dicts: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(dicts, tools=tools or None, chat_template=self.template,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  **self.template_kwargs)

    @staticmethod
    def _template_dict(m: Message, max_tool_calls: int | None = None) -> dict[str, Any]:
        d = m.to_dict()
        if m.tool_calls:  # templates expect arguments as an object (Qwen2.5 double-encodes strings)
            d["tool_calls"] = [
                {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                for tc in m.tool_calls[:max_tool_calls]
            ]
        return d

    def encode(self, text: str) -> list[int]:
        """Tokenize template output. Special tokens appear in the text, so none are added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, messages: Sequence[Message], tools: list[dict] | None = None) -> list[int]:
        dicts, held = self._hold_content([self._template_dict(m) for m in messages])
        return self._encode_rendered(self._render_dicts(dicts, tools, True), held)

    def _hold_content(self, dicts: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
        """`dicts` with every content that holds a special token's text replaced by a placeholder
        (NUL-delimited, so no template or text produces it), and the contents held back, in order."""
        held: list[str] = []
        for d in dicts:
            content = d.get("content")
            if isinstance(content, str) and self._special_text is not None and self._special_text.search(content):
                d["content"] = f"\x00agentgrpo-content-{len(held)}\x00"
                held.append(content)
        return dicts, held

    def _encode_rendered(self, text: str, held: list[str]) -> list[int]:
        """Tokenize template output; the held-back contents go where their placeholders are,
        tokenized with special tokens split into plain text."""
        if not held:
            return self.encode(text)
        ids: list[int] = []
        for i, content in enumerate(held):
            mark = f"\x00agentgrpo-content-{i}\x00"
            if text.count(mark) != 1:
                raise TemplateError(f"the chat template renders a message {text.count(mark)} times instead of once; "
                                    "its text (which contains a special token's text) cannot be kept as plain text")
            before, text = text.split(mark)
            ids += self.encode(before) + self.tokenizer.encode(content, add_special_tokens=False,
                                                               split_special_tokens=True)
        return ids + self.encode(text)

    def suffix_ids(self, history: Sequence[Message], new_messages: Sequence[Message],
                   tools: list[dict] | None = None, *, max_tool_calls: int | None = None) -> list[int]:
        """Ids to append after the model's end-of-turn token so that the sequence continues as
        `render(history + new_messages, add_generation_prompt=True)` would.

        `history` must end with the assistant message whose sampled ids end with the end-of-turn
        token. Raises TemplateError when the template rewrites earlier turns (not prefix-preserving,
        unless `fallback="keep_history"`), refuses the conversation, or renders the assistant turn
        without the end-of-turn token.

        `max_tool_calls`: assistant messages of `history` are rendered with at most this many of
        their tool calls, the ones the env ran (a `ToolEnv` answers the rest with a too-many-calls
        error). The rendering only locates the suffix, which starts after the end-of-turn token; the
        assistant turns themselves stay the sampled ids. So a template without parallel calls
        (Llama 3.1 refuses two in one turn) can continue a turn in which the model made several,
        once the env runs one per turn.
        """
        if not history or history[-1].role != "assistant":
            raise ValueError("suffix_ids: history must end with the assistant message just sampled")
        history_dicts = [self._template_dict(m, max_tool_calls) for m in history]  # built once for both renders
        new_dicts, held = self._hold_content([self._template_dict(m) for m in new_messages])
        before = self._render_dicts(history_dicts, tools, False)
        after = self._render_dicts(history_dicts + new_dicts, tools, True)
        cut = before.rfind(self.end_of_turn)
        if cut < 0:
            raise TemplateError(
                f"the chat template renders the assistant turn without {self.end_of_turn!r}; "
                "cannot align the suffix with the sampled end-of-turn token"
            )
        glue = before[cut + len(self.end_of_turn):]
        if after.startswith(before):
            return self._encode_rendered(glue + after[len(before):], held)
        if self.fallback == "keep_history":
            return self._encode_rendered(self._suffix_after_last_turn(before, after, glue), held)
        at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(before))
        raise TemplateError(
            "the chat template is not prefix-preserving: adding "
            f"{[m.role for m in new_messages]} messages changes earlier text at character {at} "
            f"(before: {before[max(0, at - 40):at + 40]!r}, after: {after[max(0, at - 40):at + 40]!r}). "
            "The tokens the model saw cannot be continued the way this template renders the "
            "conversation. Use a template that keeps earlier turns verbatim (or its own switch, e.g. "
            "chat_template_kwargs={preserve_thinking: true}), or choose the explicit fallback "
            "rollout.template_fallback=keep_history. `agentgrpo check-template MODEL_DIR` shows "
            "which turns break and why."
        )

    def _suffix_after_last_turn(self, before: str, after: str, glue: str) -> str:
        """keep_history: the text `after` renders behind the last assistant turn.

        The rewrite of earlier turns (dropping reasoning, reformatting) keeps their number of
        end-of-turn markers, so the k-th marker of `after` (k = markers in `before`) ends the
        assistant turn just sampled; the template's glue after it is checked to be unchanged.
        """
        k = before.count(self.end_of_turn)
        pos = -len(self.end_of_turn)
        for _ in range(k):
            pos = after.find(self.end_of_turn, pos + len(self.end_of_turn))
            if pos < 0:
                break
        tail = after[pos + len(self.end_of_turn):] if pos >= 0 else ""
        if pos < 0 or not tail.startswith(glue) or tail == glue:
            raise TemplateError(
                "keep_history fallback: cannot locate the new messages in the template's rendering "
                f"(it changes the number of {self.end_of_turn!r} markers in earlier turns)"
            )
        return tail

    def truncate(self, text: str, max_tokens: int, marker: str = TRUNCATION_MARKER) -> tuple[str, int]:
        """Cut `text` to its first `max_tokens` tokens plus `marker` (`{omitted}` is replaced by
        the number of tokens dropped; any other braces are plain text, not a format string).
        Returns (text, tokens omitted). Used on tool output before it is rendered, so the model
        sees that the output was cut rather than a silent end."""
        if len(text.encode("utf-8")) <= max_tokens:  # a token covers at least one byte
            return text, 0
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text, 0
        kept = self.tokenizer.decode(ids[:max_tokens], skip_special_tokens=False).rstrip("\ufffd")
        omitted = len(ids) - max_tokens
        return kept + marker.replace("{omitted}", str(omitted)), omitted

    # -- parsing ------------------------------------------------------------------------------

    def parse_assistant(self, sampled_ids: Sequence[int], *, parse_tools: bool = True) -> ParsedTurn:
        """Turn one assistant turn's sampled ids into a Message (and malformed calls).

        Decoding is for reading only: the ids themselves are what the trajectory keeps. With
        `parse_tools=False` (an env without tools) the whole text is the content: tool-call syntax
        means nothing there, and the env should judge exactly what the model wrote.
        """
        ids = list(sampled_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        if not parse_tools:
            return ParsedTurn(Message(role="assistant", content=self.decode(ids).strip()))
        return self.parse(self.decode(ids))
