"""OpenAI's Responses API (`POST /episodes/<id>/v1/responses`) as a translation onto the episode's
Chat Completions core (`EndpointEpisode.complete`), so its calls land in the same record.

A request becomes chat messages: `instructions` a system message, `input` text a user message,
and input items in order (messages, `function_call` / `function_call_output`, `reasoning` joined
back to its reply text by `agentgrpo.agents.thinking`, `item_reference`s to items this episode
returned). The items of one reply become one assistant message again, so the conversation the
client sends back continues the episode's tokens; `previous_response_id` continues a response of
this episode. The reply's text, calls and reasoning become `message`, `function_call` and
`reasoning` items; `stream` sends OpenAI's `response.*` events (`agentgrpo.agents.streaming`).

Not carried (docs/agents.md has the field table and this list): tools other than functions,
non-text input, structured output, `background`, `conversation`, stored prompts.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response

from agentgrpo.agents.api_error import APIError, check_model
from agentgrpo.agents.streaming import sse_response
from agentgrpo.agents.thinking import Thought, join_thinking, split_thinking

if TYPE_CHECKING:
    from agentgrpo.agents.endpoint import EndpointEpisode

# Fields that do not change what is sampled: accepted and ignored.
IGNORED = frozenset(
    {
        "store",
        "metadata",
        "user",
        "parallel_tool_calls",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "include",
        "reasoning",
        "top_logprobs",
        "stream_options",
        "context_management",
    }
)
HONOURED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "temperature",
        "top_p",
        "max_output_tokens",
        "previous_response_id",
        "stream",
    }
)
# Fields accepted only with their default value (anything else would change what is sampled or
# needs what this endpoint does not have).
DEFAULT_ONLY = {
    "text": (None, {"format": {"type": "text"}}, {"format": {"type": "text"}, "verbosity": None}),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
}
ASSISTANT_KINDS = {"reasoning": 0, "message": 1, "function_call": 2}  # their order in one reply


async def answer(ep: EndpointEpisode, body: Any, served: str) -> Response:
    """One Responses API call on episode `ep` (the route's `answer`)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_fields(body)
    model = check_model(body.get("model"), served)
    state = ep.api_state.setdefault("responses", {"responses": {}, "items": {}, "thoughts": {}})
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "instructions must be a string", param="instructions")
    conversation = _previous(state, body.get("previous_response_id"))
    conversation += _input_messages(body.get("input"), state)
    system = [{"role": "system", "content": instructions}] if instructions else []
    tools = _tools(body.get("tools"))
    chat = {
        "model": model,
        "messages": system + conversation,
        "tools": tools,
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_completion_tokens": body.get("max_output_tokens"),
    }
    reply = await ep.complete({k: v for k, v in chat.items() if v is not None})
    response = _response(reply, body, model, state)
    state["responses"][response["id"]] = [*conversation, _assistant_dict(reply)]
    if body.get("stream") is True:
        return sse_response(stream_events(response))
    return JSONResponse(response)


def _check_fields(body: dict[str, Any]) -> None:
    for key, value in body.items():
        if key in HONOURED or key in IGNORED:
            continue
        if key in DEFAULT_ONLY:
            if value in DEFAULT_ONLY[key]:
                continue
            raise APIError(
                400,
                f"{key}={value!r:.100} is not supported by this endpoint",
                param=key,
                code="unsupported_parameter",
            )
        raise APIError(400, f"Unknown parameter: '{key}'.", param=key, code="unknown_parameter")
    if body.get("stream") not in (None, True, False):
        raise APIError(400, "stream must be a boolean", param="stream")


def _previous(state: dict[str, Any], rid: Any) -> list[dict[str, Any]]:
    if rid is None:
        return []
    if rid not in state["responses"]:
        raise APIError(
            400,
            f"Previous response with id '{rid!s:.100}' not found (in this episode).",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return list(state["responses"][rid])


def _text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or text parts (any other part is a 400)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str
            ):
                raise APIError(
                    400,
                    f"{where}: content part of type {kind!r}: only text parts are supported",
                    param=where,
                )
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"{where}: content must be a string or a list of parts", param=where)


def _input_messages(raw: Any, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages of `input`: a user message for text; for items, in order, with the items of
    one assistant reply (reasoning, message, function calls) joined into one assistant message."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise APIError(400, "input must be a string or a list of items", param="input")
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being joined
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if isinstance(item, dict) and item.get("type") == "item_reference":
            item = state["items"].get(item.get("id"))
            if item is None:
                raise APIError(400, f"{where}: no item with that id in this episode", param=where)
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: an item must be an object", param=where)
        kind = item.get("type", "message")
        role = item.get("role")
        if kind in ASSISTANT_KINDS and (kind != "message" or role == "assistant"):
            source = state["items"].get(item.get("id"), {}).get("_response")
            if turn is not None and (
                ASSISTANT_KINDS[kind] < turn["_rank"] or source != turn["_source"]
            ):
                out.append(_close(turn))
                turn = None
            if turn is None:
                turn = {"_rank": 0, "_source": source, "thought": None, "text": "", "calls": []}
            turn["_rank"] = ASSISTANT_KINDS[kind]
            _add_to_turn(turn, kind, item, where, state)
            continue
        if turn is not None:
            out.append(_close(turn))
            turn = None
        out.append(_other_item(kind, item, where))
    if turn is not None:
        out.append(_close(turn))
    return out


def _add_to_turn(
    turn: dict[str, Any], kind: str, item: dict[str, Any], where: str, state: dict[str, Any]
) -> None:
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        if not isinstance(parts, list):
            raise APIError(400, f"{where}: reasoning content must be a list", param=where)
        text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        known = state["thoughts"].get(item.get("id"))
        turn["thought"] = (
            Thought(text, *known) if known else Thought.signed(text, item.get("encrypted_content"))
        )
    elif kind == "message":
        turn["text"] += _text(item.get("content"), where)
    else:
        name, args, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
        if not (isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str)):
            raise APIError(
                400,
                f"{where}: a function_call needs call_id, name and arguments (strings)",
                param=where,
            )
        turn["calls"].append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        )


def _close(turn: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": join_thinking(turn["thought"], turn["text"]),
    }
    if turn["calls"]:
        message["tool_calls"] = turn["calls"]
    return message


def _other_item(kind: str, item: dict[str, Any], where: str) -> dict[str, Any]:
    if kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise APIError(400, f"{where}: function_call_output needs a call_id", param=where)
        output = _text(item.get("output"), where)
        return {"role": "tool", "tool_call_id": call_id, "content": output}
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer"):
            raise APIError(400, f"{where}: unknown role {role!r:.50}", param=where)
        return {
            "role": "system" if role == "developer" else role,
            "content": _text(item.get("content"), where),
        }
    raise APIError(
        400,
        f"{where}: items of type {kind!r:.50} are not supported (messages, function_call, "
        "function_call_output, reasoning and item_reference are)",
        param=where,
    )


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if not raw:
        return None
    if not isinstance(raw, list):
        raise APIError(400, "tools must be a list", param="tools")
    tools = []
    for i, t in enumerate(raw):
        if not (
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)
        ):
            raise APIError(
                400,
                f"tools[{i}]: only function tools ({{type: function, name, parameters}}) are "
                "supported",
                param=f"tools[{i}]",
            )
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(raw: Any) -> Any:
    if raw is None or raw in ("none", "auto", "required"):
        return raw  # "required" without tools: the chat core's 400
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise APIError(
        400,
        f"tool_choice={raw!r:.100}: expected none, auto, required or {{type: function, name}}",
        param="tool_choice",
    )


def _assistant_dict(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply as the chat message the episode recorded (its conversation goes on from it)."""
    message = reply["choices"][0]["message"]
    out = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def _response(
    reply: dict[str, Any], body: dict[str, Any], model: str, state: dict[str, Any]
) -> dict[str, Any]:
    """The chat reply as a `response` object; its output items go into the episode's table."""
    rid = f"resp_{secrets.token_hex(16)}"
    message = reply["choices"][0]["message"]
    thought, text = split_thinking(message.get("content") or "")
    include = body.get("include") or []
    items: list[dict[str, Any]] = []
    if thought is not None:
        item = {
            "id": f"rs_{secrets.token_hex(16)}",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": thought.text}],
            "status": "completed",
        }
        if "reasoning.encrypted_content" in include:
            item["encrypted_content"] = thought.signature
        state["thoughts"][item["id"]] = (thought.before, thought.after)
        items.append(item)
    if text or not message.get("tool_calls"):
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        items.append(
            {
                "id": f"msg_{secrets.token_hex(16)}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [part],
            }
        )
    for call in message.get("tool_calls") or []:
        items.append(
            {
                "id": f"fc_{secrets.token_hex(16)}",
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    for item in items:
        state["items"][item["id"]] = {**item, "_response": rid}
    cut = reply["choices"][0]["finish_reason"] == "length"
    usage = reply["usage"]
    return {
        "id": rid,
        "object": "response",
        "created_at": float(reply["created"]),
        "status": "incomplete" if cut else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": items,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def stream_events(response: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The `response.*` events OpenAI streams for `response`: created and in progress, each
    output item added, its text, reasoning or arguments (one delta each) and done, then
    completed (or incomplete)."""
    events: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **data}))

    opening = {**response, "status": "in_progress", "output": [], "usage": None}
    opening["incomplete_details"] = None
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    for i, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "function_call":
            emit("response.output_item.added", output_index=i, item={**item, "arguments": ""})
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, arguments=item["arguments"])
        else:
            reasoning = item["type"] == "reasoning"
            emit("response.output_item.added", output_index=i, item={**item, "content": []})
            for j, part in enumerate(item["content"]):
                empty = {**part, "text": ""}
                emit("response.content_part.added", **at, content_index=j, part=empty)
                if reasoning:
                    emit("response.reasoning_text.delta", **at, content_index=j, delta=part["text"])
                    emit("response.reasoning_text.done", **at, content_index=j, text=part["text"])
                else:
                    text = {**at, "content_index": j, "logprobs": []}
                    emit("response.output_text.delta", **text, delta=part["text"])
                    emit("response.output_text.done", **text, text=part["text"])
                emit("response.content_part.done", **at, content_index=j, part=part)
        emit("response.output_item.done", output_index=i, item=item)
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    emit(done, response=response)
    return events
