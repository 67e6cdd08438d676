"""What the server pool (`pool.py`) needs to know of one engine's HTTP protocol: a `Wire` per
engine (paths, request-id key, how error bodies read), and the folder of streamed answers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class StreamReader(Protocol):
    """Folds the chunks of one streamed generate request (`Wire.new_stream`)."""

    def feed(self, chunk: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class Wire:
    """What the pool needs to know of one engine's HTTP protocol (one per engine, next to its
    client): where requests and health probes go, how errors read."""

    name: str  # in messages and logs: "SGLang", "vLLM"
    generate_path: str  # where generate requests are POSTed
    health_path: str  # GET: 200 once the server can generate
    request_id_key: str  # body key of the request id, fresh per attempt
    error_message: Callable[[bytes], str]  # the human message of an error body
    is_context_length_error: Callable[[str], bool]  # the 400 that becomes a `length` Completion
    not_ready_hint: str = ""  # appended to wait_ready's error
    new_stream: Callable[[], StreamReader] | None = None  # streamed requests' chunk folder


def error_message(body: bytes) -> str:
    """The human message of a server's error body: OpenAI's `{"error": {"message"}}` (vLLM, SGLang),
    `{"error": "..."}`, FastAPI's `{"message"}`/`{"detail"}`, or the text itself."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500]
    if isinstance(obj, Mapping):
        err = obj.get("error")
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if key in obj:
                return str(obj[key])
    return str(obj)[:500]
