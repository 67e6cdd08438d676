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
  `TemplateError` instead of training on tokens the model never saw.

Templates without tool support (SmolLM2 ships plain ChatML) get `HERMES_CHATML_TEMPLATE`, a
Hermes-style tool-aware ChatML template: tools are described in the system message, calls are
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results come back in a `tool` turn.

Tool-call parsers are pluggable (`PARSERS`); a parser never raises on model output: malformed
calls come back as `ParseError`s that the rollout turns into error tool messages.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentgrpo.types import Message, ToolCall

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


class TemplateError(ValueError):
    """The chat template cannot produce token-exact multi-turn rollouts for this conversation."""


# ---------------------------------------------------------------------------------------------
# Tool-call parsing


@dataclass
class ParseError:
    """One malformed tool call: what the model wrote and why it could not be used."""

    raw: str
    reason: str


@dataclass
class ParsedTurn:
    message: Message  # the assistant message (content + well-formed tool calls)
    errors: list[ParseError] = field(default_factory=list)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:12]


def _decode_call(raw: str) -> ToolCall | ParseError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ParseError(raw, f"the tool call is not valid JSON ({e.msg} at position {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParseError(raw, 'a tool call must be a JSON object with a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ParseError(raw, '"arguments" must be a JSON object')
    if not isinstance(args, dict):
        return ParseError(raw, '"arguments" must be a JSON object')
    return ToolCall(id=_call_id(), name=obj["name"], arguments=args)


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes/Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number.

    Text outside the tags is the message content. An unclosed `<tool_call>` at the end (the turn
    hit its token limit) is a malformed call, not silently dropped.
    """
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    for m in _HERMES_CALL.finditer(text):
        raw = m.group(1).strip()
        if not m.group(2):
            errors.append(ParseError(raw, "the tool call was not closed with </tool_call>"))
            continue
        call = _decode_call(raw)
        (errors if isinstance(call, ParseError) else calls).append(call)
    content = _HERMES_CALL.sub("", text).strip()
    return ParsedTurn(Message(role="assistant", content=content, tool_calls=calls or None), errors)


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}


def get_parser(name: str) -> Callable[[str], ParsedTurn]:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {sorted(PARSERS)}")
    return PARSERS[name]


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

    Example:
        >>> chat = ChatFormat(tokenizer)
        >>> ids = chat.prompt_ids([Message(role="user", content="2+2?")], tools=[add.schema])
        >>> turn = chat.parse_assistant(sampled_ids)        # Message + malformed calls
        >>> ids += sampled_ids + chat.suffix_ids(history, tool_messages, tools)
    """

    def __init__(self, tokenizer: Any, *, template: str | None = None, parser: str = "hermes",
                 end_of_turn: str | None = None) -> None:
        self.tokenizer = tokenizer
        if template is not None:
            self.template, self.template_source = template, "config"
        elif template_supports_tools(getattr(tokenizer, "chat_template", None)):
            self.template, self.template_source = tokenizer.chat_template, "tokenizer"
        else:
            self.template, self.template_source = HERMES_CHATML_TEMPLATE, "agentgrpo-hermes-chatml"
        self.parse = get_parser(parser)
        self.parser_name = parser
        eot = end_of_turn or tokenizer.eos_token
        if eot is None:
            raise ValueError("the tokenizer has no EOS token: pass end_of_turn= explicitly")
        eot_ids = tokenizer.convert_tokens_to_ids([eot])
        if not eot_ids or eot_ids[0] is None or eot_ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"end-of-turn token {eot!r} is not a single token of this tokenizer")
        self.end_of_turn = eot
        self.end_of_turn_id: int = eot_ids[0]
        stops = {self.end_of_turn_id}
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))

    # -- rendering ----------------------------------------------------------------------------

    def render(self, messages: Sequence[Message], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        out = self.tokenizer.apply_chat_template(
            [self._template_dict(m) for m in messages],
            tools=tools or None,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return out

    @staticmethod
    def _template_dict(m: Message) -> dict[str, Any]:
        d = m.to_dict()
        if m.tool_calls:  # templates expect arguments as an object (Qwen2.5 double-encodes strings)
            d["tool_calls"] = [
                {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                for tc in m.tool_calls
            ]
        return d

    def encode(self, text: str) -> list[int]:
        """Tokenize template output. Special tokens appear in the text, so none are added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, messages: Sequence[Message], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def suffix_ids(self, history: Sequence[Message], new_messages: Sequence[Message],
                   tools: list[dict] | None = None) -> list[int]:
        """Ids to append after the model's end-of-turn token so that the sequence continues as
        `render(history + new_messages, add_generation_prompt=True)` would.

        `history` must end with the assistant message whose sampled ids end with the end-of-turn
        token. Raises TemplateError when the template rewrites earlier turns (not prefix-preserving)
        or renders the assistant turn without the end-of-turn token.
        """
        if not history or history[-1].role != "assistant":
            raise ValueError("suffix_ids: history must end with the assistant message just sampled")
        before = self.render(history, tools, add_generation_prompt=False)
        after = self.render(list(history) + list(new_messages), tools, add_generation_prompt=True)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(before))
            raise TemplateError(
                "the chat template is not prefix-preserving: adding "
                f"{[m.role for m in new_messages]} messages changes earlier text at character {at} "
                f"(before: {before[max(0, at - 40):at + 40]!r}, after: {after[max(0, at - 40):at + 40]!r}). "
                "Training on this would use tokens the model never saw; use a template that keeps "
                "earlier turns verbatim (see `agentgrpo check-template`)."
            )
        cut = before.rfind(self.end_of_turn)
        if cut < 0:
            raise TemplateError(
                f"the chat template renders the assistant turn without {self.end_of_turn!r}; "
                "cannot align the suffix with the sampled end-of-turn token"
            )
        glue = before[cut + len(self.end_of_turn):]
        return self.encode(glue + after[len(before):])

    # -- parsing ------------------------------------------------------------------------------

    def parse_assistant(self, sampled_ids: Sequence[int]) -> ParsedTurn:
        """Turn one assistant turn's sampled ids into a Message (and malformed calls).

        Decoding is for reading only: the ids themselves are what the trajectory keeps.
        """
        ids = list(sampled_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.parse(self.decode(ids))
