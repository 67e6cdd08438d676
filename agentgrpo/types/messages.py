"""What users and models exchange: `Message` (OpenAI-style, validated where it comes in),
`ToolCall` and `Task`. Pydantic models, frozen where the pipeline keeps them."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(BaseModel):
    """One function call requested by the model.

    `arguments` is the decoded JSON object. OpenAI's wire format carries arguments as a JSON
    *string*; validation (`ToolCall(**d)`, `model_validate`, `from_dict`) accepts both and
    `to_dict` emits the string form.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = ""
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _openai_form(cls, d: Any) -> Any:
        if not (isinstance(d, dict) and "function" in d):
            return d
        # OpenAI: {"id", "type": "function", "function": {"name", "arguments": "<JSON string>"}}
        if d.get("type", "function") != "function":
            raise ValueError(f"tool call of type {d['type']!r}: only 'function' calls exist here")
        fn = d["function"]
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"tool call {fn.get('name')!r}: arguments are not JSON ({e})"
                ) from e
        return {"id": d.get("id") or "", "name": fn.get("name"), "arguments": args}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolCall:
        return cls.model_validate(d)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


class Message(BaseModel):
    """A chat message. Accepts and emits OpenAI-style dicts (`Message.from_dict`, `to_dict`).

    Validation anywhere (`Message(**d)`, `Task(prompt=[...])`, `model_validate`) takes what
    OpenAI's API and chat datasets write: `content: null` (an assistant turn that only calls tools)
    and content as a list of text parts (joined); tool calls in OpenAI's form; keys OpenAI sends
    empty (`refusal: null`, `annotations: []`, ...) are dropped. An unknown key with a value, or a
    non-text content part (an image), is an error that names it: text is all the model sees here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _openai_form(cls, d: Any) -> Any:
        if not isinstance(d, dict):
            return d
        known = cls.model_fields
        d = {k: v for k, v in d.items() if k in known or v not in (None, "", [], {})}
        content = d.get("content")
        if content is None:
            d["content"] = ""
        elif isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
            if any(k != "text" for k in kinds):
                raise ValueError(
                    f"content parts of type {sorted({k for k in kinds if k != 'text'})}: only "
                    "text parts are supported"
                )
            d["content"] = "".join(p.get("text", "") for p in content)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Message) -> Message:
        return d if isinstance(d, Message) else cls.model_validate(d)

    def to_dict(self) -> dict[str, Any]:
        """OpenAI-style dict; optional fields are present only when set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [tc.to_dict() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class Task(BaseModel):
    """One problem: a prompt (text or messages), an optional reference answer, free metadata."""

    model_config = ConfigDict(extra="forbid")

    id: str
    prompt: str | list[Message]
    answer: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    def prompt_messages(self) -> list[Message]:
        if isinstance(self.prompt, str):
            return [Message(role="user", content=self.prompt)]
        return list(self.prompt)
