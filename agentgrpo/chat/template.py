"""The default tool-aware chat template (Hermes-style ChatML), and the shortcut that renders a
template through transformers' compiled Jinja instead of `apply_chat_template`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jinja2

# `render(dicts, tools, add_generation_prompt)`: the template's text, TemplateError on refusal
Render = Callable[[list[dict[str, Any]], list[dict] | None, bool], str]

HERMES_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou can call these functions. "
    "Their signatures are inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object inside "
    "<tool_call></tool_call> tags:\\n"
    '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
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

    def render(
        dicts: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool
    ) -> str:
        return compiled.render(
            messages=dicts,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    return render


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and "tool_call" in template
