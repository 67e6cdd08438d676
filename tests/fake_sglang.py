"""A fake SGLang server: real HTTP on loopback, SGLang's wire protocol, no GPU.

It implements the server side of docs/serving.md so that `SGLangEngine` can be
tested end to end on a CPU:

- `/generate`: single, batch (list input) and `n > 1` requests; rid rules (list length, string
  expansion, duplicate in-flight rid -> 400); default `max_new_tokens` 128; the context-length 400
  with SGLang's exact message; EOS ids = model EOS + `stop_token_ids`; `stop` strings; the `text`
  trimming rules; `[logprob, id, text|null]` tuples; both `input_token_logprobs` forms; top
  logprobs; every `finish_reason` variant; SSE with cumulative (default) or incremental chunks and
  `[DONE]`, a validation error of a streamed request as an error event (HTTP 200, as SGLang);
  aborts answer 200 with the partial output; unknown `sampling_params` keys -> 500.
- Versions: `legacy=None` (HEAD shapes), `"0.5.2"` or `"0.4.6"` (older meta keys and shapes), and
  `skip_tokenizer_init=True` (no text).
- Concurrency: generation holds a reader lock, weight updates a writer lock; `/pause_generation`
  blocks new generations (mode abort aborts the running ones; retract and in_place keep them, they
  decode no token until `/continue_generation`, and a weight update meanwhile runs at once, the
  tokens after it stamped with the new version in every chunk); `/flush_cache` is 400 while busy,
  which requests parked by a retract / in_place pause are (stock SGLang; `retract_flush=True` is a
  build that flushes while paused in retract mode, sgl-project/sglang#33784), and a weight update
  asking to flush the cache then kills the scheduler (its assert: 500, then unhealthy);
  `/release_memory_occupation` while busy is fatal (500, then unhealthy), and so is a weight update
  while the weights are released; `enable_memory_saver` in `/server_info` is the `memory_saver`
  argument (SGLang's --enable-memory-saver); `/health_generate` is 503
  until `start_delay_s` has passed.
- Weights: `/update_weights_from_disk`, `/update_weights_from_tensor` (opaque base64),
  `/init_weights_update_group` + `/update_weights_from_distributed` (a real torch.distributed
  broadcast, gloo on CPU: the calls block until the trainer joins and broadcasts, as in SGLang),
  `/update_weight_version`; all update `weight_version` and `model_path`.
- `--api-key` / `--admin-api-key` auth, and fault injection (`FakeSGLang.faults`).

Outputs come from a script (deterministic token ids keyed by the prompt) or from any `backend`
object with `async generate(prompt_ids, SamplingParams) -> Completion` (e.g. `LocalEngine`, or
`TinyModelBackend` below); a backend with `update_weights` receives the weight updates and one
with `score` provides prompt logprobs. Not implemented: `/v1/chat/completions`,
`/parse_function_call`, sessions, multimodal input (the client never uses them).

Run it in another process with `python -m tests.fake_sglang --port 0 [--model-path DIR
--backend model]`; it prints `FAKE_SGLANG_READY <url>` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import json
import os
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentgrpo.engine.base import Completion, SamplingParams

QWEN_SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "ignore_eos",
        "min_new_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "n",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "stream_interval",
    }
)
ADMIN_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/update_weight_version",
    }
)
REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
CONTEXT_MSG = (
    "Requested token count exceeds the model's maximum context length of {C} tokens. You "
    "requested a total of {T} tokens: {P} tokens from the input messages and {N} tokens for the "
    "completion. Please reduce the number of tokens in the input messages or the completion to "
    "fit within the limit."
)
ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


def scripted_logprob(position: int, token_id: int) -> float:
    """The logprob the scripted mode reports for `token_id` at output `position` (for asserts)."""
    return -round(0.05 + 0.01 * (position % 10) + 0.001 * (token_id % 7), 6)


@dataclass
class Faults:
    """Fault injection. `queue` holds one fault per coming `/generate` HTTP request, in order:
    "400" (a validation error), "503", "500", "drop" (close the connection without answering),
    "abort" (finish with an abort after two tokens), "hang" (never answer), "context" (the
    context-length 400)."""

    queue: deque[str] = field(default_factory=deque)
    generate_delay_s: float = 0.0  # added before every /generate answer
    token_delay_s: float = 0.0  # per generated token (lets tests pause/abort mid-generation)
    ignore_weight_updates: bool = False  # accept updates but keep the old weights (probe tests)

    def inject(self, *kinds: str) -> None:
        for k in kinds:
            if k not in ("400", "503", "500", "drop", "abort", "hang", "context"):
                raise ValueError(f"unknown fault {k!r}")
        self.queue.extend(kinds)


class FakeTokenizer:
    """Deterministic toy tokenizer: special tokens by table, other ids are `chr(id)`."""

    def __init__(
        self, special: Mapping[int, str] | None = None, vocab: Mapping[int, str] | None = None
    ) -> None:
        self.special = dict(QWEN_SPECIAL if special is None else special)
        self.table = {**(vocab or {}), **self.special}
        self._by_text = sorted(((t, i) for i, t in self.special.items()), key=lambda x: -len(x[0]))

    def decode_one(self, token_id: int) -> str:
        if token_id in self.table:
            return self.table[token_id]
        return chr(token_id) if 0 <= token_id < 0x110000 else f"<{token_id}>"

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for t, tid in self._by_text:
                if text.startswith(t, i):
                    ids.append(tid)
                    i += len(t)
                    break
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids


class _SchedulerCrash(Exception):
    """SGLang's scheduler process dies (an assert in it): the whole server goes down."""


class _HTTPError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status)
        self.status, self.body = status, body


def _value_error(message: str) -> _HTTPError:
    """SGLang maps a ValueError during validation to 400 {"error": {"message"}}."""
    return _HTTPError(400, {"error": {"message": message}})


def _schema_error(message: str) -> _HTTPError:
    return _HTTPError(
        400,
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
    )


@dataclass
class _Item:
    """One sequence being generated (a batch or n > 1 request has several)."""

    rid: str
    index: int
    prompt: list[int]
    sp: dict[str, Any]
    return_logprob: bool
    logprob_start_len: int
    top_k: int
    text_in_logprobs: bool
    started: bool = False
    t0: float = 0.0
    prompt_lps: list[float] | None = None  # from the backend's score(), when it has one
    aborted: bool = False
    finished: bool = False
    scheduled: bool = False  # past the pause gate and the model lock: in the scheduler's queues
    produced: int = 0  # tokens decoded so far


class _RWLock:
    """Many generations or one weight update; a waiting update blocks new generations."""

    def __init__(self) -> None:
        self.readers = 0
        self.writer = False
        self.writers_waiting = 0
        self.cond = asyncio.Condition()

    async def acquire_read(self) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writer and not self.writers_waiting)
            self.readers += 1

    async def release_read(self) -> None:
        async with self.cond:
            self.readers -= 1
            self.cond.notify_all()

    async def acquire_write(self) -> None:
        async with self.cond:
            self.writers_waiting += 1
            try:
                await self.cond.wait_for(lambda: not self.writer and self.readers == 0)
            finally:
                self.writers_waiting -= 1
            self.writer = True

    async def release_write(self) -> None:
        async with self.cond:
            self.writer = False
            self.cond.notify_all()


Script = (
    Callable[[list[int]], Sequence[int | tuple[int, float]]]
    | Mapping[tuple[int, ...], Sequence[int | tuple[int, float]]]
)


class FakeSGLang:
    """The server. `await start()` returns its URL; tests reach its state directly.

    Example:
        ```python
        server = FakeSGLang(script={(77091, 198): [19, 151645]})   # prompt suffix -> output ids
        url = await server.start()
        ...                                                         # SGLangEngine([url])
        server.faults.inject("503", "drop")                         # next two /generate fail
        await server.stop()
        ```
    """

    def __init__(
        self,
        *,
        script: Script | None = None,
        backend: Any = None,
        eos_token_ids: Sequence[int] = (151645, 151643),
        filler_token_id: int = 220,
        context_length: int = 4096,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        legacy: str | None = None,
        skip_tokenizer_init: bool = False,
        incremental_streaming: bool = False,
        start_delay_s: float = 0.0,
        model_path: str = "fake/Qwen2.5-0.5B-Instruct",
        tp_size: int = 1,
        version: str = "0.5.15.post1",
        weight_version: str = "default",
        special_tokens: Mapping[int, str] | None = None,
        vocab: Mapping[int, str] | None = None,
        calls_log: str | None = None,
        memory_saver: bool = False,
        retract_flush: bool = False,
    ) -> None:
        if legacy not in (None, "0.5.2", "0.4.6"):
            raise ValueError(f"legacy must be None, '0.5.2' or '0.4.6', got {legacy!r}")
        self.script, self.backend = script, backend
        self.eos_token_ids = set(eos_token_ids)
        self.filler_token_id = filler_token_id
        self.context_length = context_length
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.legacy = legacy
        self.skip_tokenizer_init = skip_tokenizer_init
        self.incremental_streaming = incremental_streaming
        self.start_delay_s = start_delay_s
        self.model_path = model_path
        self.tp_size = tp_size
        self.version = (
            version if legacy is None else {"0.5.2": "0.5.2", "0.4.6": "0.4.6.post5"}[legacy]
        )
        self.weight_version = weight_version
        self.tokenizer = FakeTokenizer(special_tokens, vocab)
        self.calls_log = calls_log  # append every control call as a JSON line (subprocess tests)
        self.memory_saver = memory_saver  # launched with --enable-memory-saver
        self.retract_flush = retract_flush  # can flush while paused in retract mode (see above)
        self.pause_mode: str | None = None  # of the pause in force
        self.pauses: list[dict[str, int]] = []  # per pause: tokens decoded by each live request
        self.peak_inflight = 0  # most sequences generating at once (bounded-concurrency tests)
        self.faults = Faults()
        self.requests: list[dict[str, Any]] = []  # every /generate body, for assertions
        self.calls: list[tuple[str, Any]] = []  # every control call (path, body), in order
        self.host, self.port = "127.0.0.1", 0
        self.unhealthy = False
        self.paused = False
        self.released_tags: set[str] = set()
        self._items: dict[str, _Item] = {}
        self._cache: deque[list[int]] = deque(maxlen=16)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._conn_tasks: set[asyncio.Task[None]] = set()
        self._started_at = 0.0
        self._groups: dict[str, Any] = {}
        self._rw: _RWLock | None = None
        self._resume: asyncio.Event | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._rw, self._resume = _RWLock(), asyncio.Event()
        self._resume.set()
        self._server = await asyncio.start_server(self._serve_conn, host, port, backlog=1024)
        self.host, self.port = host, self._server.sockets[0].getsockname()[1]
        self._started_at = time.monotonic()
        return self.url

    async def stop(self) -> None:
        """Stop listening and drop every open connection (a dead server)."""
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            tasks = [t for t in self._conn_tasks if not t.done()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    @property
    def busy(self) -> bool:
        """Requests in the scheduler (running, or parked by a pause). Requests held at the
        tokenizer manager's pause gate or model lock are not: SGLang has not scheduled them."""
        return any(it.scheduled and not it.finished for it in self._items.values())

    def _can_flush(self) -> bool:
        return not self.busy or (self.retract_flush and self.pause_mode == "retract")

    # -- HTTP plumbing ---------------------------------------------------------------------------

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        self._conn_tasks.add(task)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while True:
                    h = await reader.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                n = int(headers.get("content-length", "0"))
                body = await reader.readexactly(n) if n else b""
                path, _, query = target.partition("?")
                if not await self._dispatch(method, path, query, headers, body, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # the client went away or sent garbage: drop the connection, like uvicorn
        except asyncio.CancelledError:
            pass  # stop(): end quietly (asyncio's stream callback chokes on a cancelled task)
        finally:
            self._writers.discard(writer)
            self._conn_tasks.discard(task)
            writer.close()

    @staticmethod
    async def _send(
        writer: asyncio.StreamWriter, status: int, body: Any, ctype: str = "application/json"
    ) -> None:
        if isinstance(body, bytes):
            data = body
        elif isinstance(body, str):
            data, ctype = body.encode(), "text/plain; charset=utf-8"
        else:
            data = json.dumps(body, separators=(",", ":")).encode()
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\ncontent-type: {ctype}\r\n"
            f"content-length: {len(data)}\r\n\r\n"
        ).encode("latin-1")
        writer.write(head + data)
        await writer.drain()

    def _auth_error(self, path: str, headers: Mapping[str, str]) -> _HTTPError | None:
        if path.startswith(("/health", "/metrics")):
            return None
        token = headers.get("authorization", "")
        token = token[7:] if token.startswith("Bearer ") else None
        if self.admin_api_key is not None and path in ADMIN_PATHS:
            return (
                None if token == self.admin_api_key else _HTTPError(401, {"error": "Unauthorized"})
            )
        if self.api_key is not None and token != self.api_key:
            return _HTTPError(401, {"error": "Unauthorized"})
        return None

    async def _dispatch(
        self,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        raw: bytes,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Answer one request; returns False when the connection must be closed."""
        try:
            err = self._auth_error(path, headers)
            if err is not None:
                raise err
            route = self._routes().get(path)
            if route is None:
                raise _HTTPError(404, {"detail": "Not Found"})
            methods, handler = route
            if method not in methods:
                raise _HTTPError(405, {"detail": "Method Not Allowed"})
            try:
                payload = json.loads(raw) if raw else None
            except ValueError as e:
                raise _schema_error(f"JSON decode error: {e}") from None
            if path != "/generate":
                self.calls.append((path, payload))
                if self.calls_log:
                    with open(self.calls_log, "a") as f:
                        f.write(json.dumps({"path": path, "body": payload}) + "\n")
            result = await handler(payload, query, writer)
        except _HTTPError as e:
            await self._send(writer, e.status, e.body)
            return True
        if result is _DROP:
            writer.transport.abort()
            return False
        if result is _STREAMED:
            return True
        status, body = result
        await self._send(writer, status, body)
        return True

    def _routes(self) -> dict[str, tuple[tuple[str, ...], Callable[..., Any]]]:
        get, post, both = ("GET",), ("POST", "PUT"), ("GET", "POST")
        return {
            "/generate": (("POST", "PUT"), self._generate),
            "/health": (get, self._health),
            "/health_generate": (get, self._health),
            "/model_info": (get, self._model_info),
            "/get_model_info": (get, self._model_info),
            "/server_info": (get, self._server_info),
            "/get_server_info": (get, self._server_info),
            "/get_weight_version": (get, self._get_weight_version),
            "/weight_version": (get, self._get_weight_version),
            "/v1/loads": (get, self._loads),
            "/get_load": (get, self._get_load),
            "/flush_cache": (both, self._flush_cache),
            "/abort_request": (post, self._abort_request),
            "/pause_generation": (post, self._pause),
            "/continue_generation": (post, self._continue),
            "/release_memory_occupation": (both, self._release_memory),
            "/resume_memory_occupation": (both, self._resume_memory),
            "/update_weight_version": (post, self._update_weight_version),
            "/update_weights_from_disk": (post, self._update_from_disk),
            "/update_weights_from_tensor": (post, self._update_from_tensor),
            "/init_weights_update_group": (post, self._init_group),
            "/update_weights_from_distributed": (post, self._update_from_distributed),
            "/destroy_weights_update_group": (post, self._destroy_group),
            "/get_weights_by_name": (both, self._get_weights_by_name),
        }

    # -- info endpoints --------------------------------------------------------------------------

    async def _health(self, body: Any, query: str, w: Any) -> tuple[int, bytes]:
        starting = time.monotonic() - self._started_at < self.start_delay_s
        return (503 if starting or self.unhealthy else 200), b""

    async def _model_info(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        info = {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        }
        if self.legacy is None:
            info |= {
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
            }
        return 200, info

    async def _server_info(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        return 200, {
            "model_path": self.model_path,
            "host": self.host,
            "port": self.port,
            "tp_size": self.tp_size,
            "dp_size": 1,
            "mem_fraction_static": 0.8,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "enable_memory_saver": self.memory_saver,
            "incremental_streaming_output": self.incremental_streaming,
            "context_length": self.context_length,
            "weight_version": self.weight_version,
            "max_total_num_tokens": 1048576,
            "max_req_input_len": self.context_length - 5,
            "internal_states": [{"last_gen_throughput": 0.0}],
            "version": self.version,
        }

    async def _get_weight_version(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        if self.legacy is None:
            raise _HTTPError(404, {"detail": "deprecated, use /model_info"})
        return 200, {"weight_version": self.weight_version}

    def _load(self) -> tuple[int, int]:
        running = sum(1 for it in self._items.values() if it.started and not it.finished)
        waiting = sum(1 for it in self._items.values() if not it.started and not it.finished)
        return running, waiting

    async def _loads(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        if self.legacy is not None:
            raise _HTTPError(404, {"detail": "Not Found"})
        params = dict(p.partition("=")[::2] for p in query.split("&") if p)
        include = set(params.get("include", "core").split(","))
        if not include <= {"core", "memory", "spec", "lora", "disagg", "queues", "all"}:
            raise _HTTPError(400, {"error": {"message": f"invalid include: {sorted(include)}"}})
        running, waiting = self._load()
        return 200, {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "version": self.version,
            "loads": [
                {
                    "timestamp": time.time(),
                    "dp_rank": 0,
                    "num_running_reqs": running,
                    "num_waiting_reqs": waiting,
                    "num_waiting_uncached_tokens": 0,
                    "num_used_tokens": 0,
                    "num_total_tokens": 1048576,
                    "max_total_num_tokens": 1048576,
                    "max_running_requests": 2048,
                    "token_usage": 0.0,
                    "gen_throughput": 0.0,
                    "cache_hit_rate": 0.0,
                    "utilization": 0.0,
                }
            ],
        }

    async def _get_load(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        running, waiting = self._load()
        return 200, [
            {
                "dp_rank": 0,
                "num_reqs": running + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": 0,
            }
        ]

    # -- control endpoints -----------------------------------------------------------------------

    async def _flush_cache(self, body: Any, query: str, w: Any) -> tuple[int, str]:
        if not self._can_flush():
            return 400, "Flush cache failed.\n"
        self._cache.clear()
        return 200, (
            "Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    def _abort(self, rid: str = "", abort_all: bool = False) -> None:
        live = [it for it in self._items.values() if not it.finished]
        if abort_all:
            targets = live
        elif (
            rid in self._items
        ):  # single tokenizer worker: only a live exact rid reaches the scheduler
            targets = [it for it in live if it.rid.startswith(rid)]
        else:
            targets = []
        for it in targets:
            it.aborted = True

    async def _abort_request(self, body: Any, query: str, w: Any) -> tuple[int, bytes]:
        body = body or {}
        self._abort(str(body.get("rid", "")), bool(body.get("abort_all", False)))
        return 200, b""

    async def _pause(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        mode = (body or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise _schema_error(f"invalid pause mode {mode!r}")
        self.paused, self.pause_mode = True, mode
        self._resume.clear()
        self.pauses.append({it.rid: it.produced for it in self._items.values() if it.scheduled})
        if mode == "abort":
            self._abort(abort_all=True)
            while self._rw.readers:  # wait until no request holds the model lock
                await asyncio.sleep(0.005)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    async def _continue(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        self.paused, self.pause_mode = False, None
        self._resume.set()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    async def _release_memory(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        if self.busy:  # SGLang's scheduler asserts idleness here: the process dies
            self.unhealthy = True
            return 500, {
                "object": "error",
                "message": "AssertionError: not fully idle",
                "type": "500",
                "param": None,
                "code": 500,
            }
        tags = (body or {}).get("tags") or ["weights", "kv_cache"]
        self.released_tags |= set(tags)
        return 200, None

    async def _resume_memory(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        tags = (body or {}).get("tags") or ["weights", "kv_cache"]
        self.released_tags -= set(tags)
        return 200, None

    async def _update_weight_version(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
            raise _schema_error("new_version: field required (str)")
        if body.get("abort_all_requests", True):
            self._abort(abort_all=True)
        self.weight_version = body["new_version"]
        return 200, {
            "success": True,
            "message": f"Weight version updated to {self.weight_version}",
            "new_version": self.weight_version,
        }

    # -- weight updates --------------------------------------------------------------------------

    async def _locked_update(self, fn: Callable[[], Any]) -> Any:
        """Run an update under the writer lock, unless generation is paused (then at once)."""
        if (
            "weights" in self.released_tags
        ):  # SGLang would write into unmapped memory: the process dies
            self.unhealthy = True
            return 500, {
                "object": "error",
                "message": "weights released: resume_memory_occupation first",
                "type": "500",
                "param": None,
                "code": 500,
            }
        try:
            if self.paused:
                return await fn()
            await self._rw.acquire_write()
            try:
                return await fn()
            finally:
                await self._rw.release_write()
        except _SchedulerCrash as e:  # SGLang's scheduler dies; the HTTP call gets an error
            self.unhealthy = True  # for good: /health_generate answers 503 from now on
            self._abort(abort_all=True)  # every request ends (aborted, with what it had)
            self.paused, self.pause_mode = False, None
            self._resume.set()
            return 500, {
                "object": "error",
                "message": str(e),
                "type": "500",
                "param": None,
                "code": 500,
            }

    def _finish_update(self, body: Mapping[str, Any], message: str) -> str:
        if body.get("flush_cache", True):
            if not self._can_flush():  # requests parked by a retract / in_place pause
                raise _SchedulerCrash("AssertionError: Cache flush failed after updating weights")
            self._cache.clear()
        v = body.get("weight_version")
        if v is not None:
            self.weight_version = str(v)
            message += f" Weight version updated to {v}."
        return message

    async def _update_from_disk(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise _schema_error("model_path: field required (str)")
        if body.get("abort_all_requests"):
            self._abort(abort_all=True)

        async def run() -> tuple[int, Any]:
            path = body["model_path"]
            if not os.path.isdir(path):
                return 400, {
                    "success": False,
                    "num_paused_requests": 0,
                    "message": f"Failed to get weights iterator: {path} (model_path not found)",
                }
            if (
                self.backend is not None
                and hasattr(self.backend, "update_weights")
                and not self.faults.ignore_weight_updates
            ):
                try:
                    await self.backend.update_weights(path, version=str(body.get("weight_version")))
                except Exception as e:  # the fake reports loader failures like SGLang does
                    return 400, {
                        "success": False,
                        "num_paused_requests": 0,
                        "message": f"Failed to update weights: {e}",
                    }
            self.model_path = path
            msg = self._finish_update(body, "Succeeded to update model weights.")
            return 200, {"success": True, "message": msg, "num_paused_requests": 0}

        return await self._locked_update(run)

    async def _update_from_tensor(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        entries = (body or {}).get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != self.tp_size:
            return 400, {
                "success": False,
                "message": "serialized_named_tensors must have one entry per TP rank "
                f"({self.tp_size})",
            }
        for e in entries:
            try:
                base64.b64decode(e, validate=True)
            except (binascii.Error, TypeError, ValueError) as err:
                return 400, {"success": False, "message": f"invalid base64 payload: {err}"}

        async def run() -> tuple[int, Any]:
            return 200, {"success": True, "message": self._finish_update(body, "Success.")}

        return await self._locked_update(run)

    async def _init_group(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        need = {
            "master_address": str,
            "master_port": (int, str),
            "rank_offset": int,
            "world_size": int,
        }
        if not isinstance(body, dict) or any(
            not isinstance(body.get(k), t) for k, t in need.items()
        ):
            raise _schema_error(f"init_weights_update_group needs {sorted(need)}")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if not 1 <= body["rank_offset"] < body["world_size"]:
            return 400, {"success": False, "message": "rank_offset must be in [1, world_size)"}
        try:
            pg = await asyncio.to_thread(
                _join_group,
                body["master_address"],
                int(body["master_port"]),
                body["rank_offset"],
                body["world_size"],
                name,
                backend,
            )
        except Exception as e:  # rendezvous timeout, bad backend: SGLang answers success=false
            return 400, {
                "success": False,
                "message": f"Failed to initialize custom process group: {e}",
            }
        self._groups[name] = pg
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    async def _update_from_distributed(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not all(
            isinstance(body.get(k), list) for k in ("names", "dtypes", "shapes")
        ):
            raise _schema_error("names, dtypes and shapes: lists required")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            return 400, {"success": False, "message": "names, dtypes and shapes differ in length"}
        pg = self._groups.get(body.get("group_name", "weight_update_group"))
        if pg is None:
            return 400, {"success": False, "message": "no weight update group with that name"}

        async def run() -> tuple[int, Any]:
            try:
                tensors = await asyncio.to_thread(_receive_broadcast, pg, dtypes, shapes)
            except Exception as e:  # reported, like SGLang's success=false
                return 400, {"success": False, "message": f"Failed to update parameter online: {e}"}
            if (
                self.backend is not None
                and hasattr(self.backend, "update_weights")
                and not self.faults.ignore_weight_updates
            ):
                await self.backend.update_weights(
                    dict(zip(names, tensors, strict=True)), version=str(body.get("weight_version"))
                )
            msg = self._finish_update(body, "Succeeded to update parameter online.")
            return 200, {"success": True, "message": msg}

        return await self._locked_update(run)

    async def _destroy_group(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        pg = self._groups.pop((body or {}).get("group_name", "weight_update_group"), None)
        if pg is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        import torch.distributed as dist

        dist.destroy_process_group(pg)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    async def _get_weights_by_name(self, body: Any, query: str, w: Any) -> tuple[int, Any]:
        getter = getattr(self.backend, "get_weight", None)
        if getter is None or not isinstance(body, dict) or "name" not in body:
            return 400, {"error": {"message": "no such parameter"}}
        k = int(body.get("truncate_size", 100))
        t = getter(body["name"])
        t = t[:k, :k] if t.dim() == 2 else t.flatten()[:k]
        return 200, t.tolist()

    # -- /generate -------------------------------------------------------------------------------

    async def _generate(self, body: Any, query: str, writer: asyncio.StreamWriter) -> Any:
        if not isinstance(body, dict):
            raise _schema_error("body must be a JSON object")
        self.requests.append(body)
        fault = self.faults.queue.popleft() if self.faults.queue else None
        if self.faults.generate_delay_s:
            await asyncio.sleep(self.faults.generate_delay_s)
        if fault == "drop":
            return _DROP
        if fault in ("503", "500"):
            return int(fault), {
                "object": "error",
                "message": f"injected {fault}",
                "type": fault,
                "param": None,
                "code": int(fault),
            }
        if fault == "400":
            raise _value_error("injected bad request")
        if fault == "hang":
            await asyncio.Event().wait()
        try:
            items, is_list, stream = self._parse_generate(body)
            if fault == "context":
                p = len(items[0].prompt)
                raise _value_error(CONTEXT_MSG.format(C=p, T=p + 1, P=p, N=1))
        except _HTTPError as e:
            if body.get("stream") and isinstance(e.body, dict) and set(e.body) == {"error"}:
                # a ValueError of a streamed request: SGLang's stream has begun (HTTP 200)
                await self._stream_events(writer, [e.body, b"[DONE]"])
                return _STREAMED
            raise
        if self.released_tags & {"weights", "kv_cache"}:
            return 500, {
                "object": "error",
                "message": "memory released",
                "type": "500",
                "param": None,
                "code": 500,
            }
        for it in items:
            self._items[it.rid] = it
        self.peak_inflight = max(
            self.peak_inflight, sum(not i.finished for i in self._items.values())
        )
        try:
            await self._resume.wait()  # new requests block while paused
            await self._rw.acquire_read()
            for it in items:
                it.scheduled = True
            try:
                if stream:
                    await self._stream(items, is_list, writer, abort_fault=fault == "abort")
                    return _STREAMED
                outs = await asyncio.gather(
                    *(self._run(it, abort_fault=fault == "abort") for it in items)
                )
            finally:
                await self._rw.release_read()
        finally:
            for it in items:
                it.finished = True
                self._items.pop(it.rid, None)
        return 200, (outs if is_list else outs[0])

    def _parse_generate(self, body: dict[str, Any]) -> tuple[list[_Item], bool, bool]:
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise _value_error("Either text or input_ids should be provided.")
        if text is not None:
            if self.skip_tokenizer_init:
                raise _value_error(
                    "text input requires a tokenizer; the server runs with --skip-tokenizer-init"
                )
            is_list = isinstance(text, list)
            texts = text if is_list else [text]
            if not all(isinstance(t, str) for t in texts):
                raise _schema_error("text must be a string or a list of strings")
            prompts = [self.tokenizer.encode(t) for t in texts]
        else:
            if not isinstance(ids, list):
                raise _schema_error("input_ids: Input should be a valid list")
            is_list = bool(ids) and isinstance(ids[0], list)
            prompts = ids if is_list else [ids]
            for p in prompts:
                if not isinstance(p, list) or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in p
                ):
                    raise _schema_error("input_ids: Input should be a list of integers")
                if not p:
                    raise _value_error("input_ids cannot be empty.")
        b = len(prompts)
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * b
        if len(sps) != b:
            raise _value_error("The length of sampling_params should match the batch size.")
        for sp in sps:
            unknown = set(sp) - SAMPLING_KEYS
            if unknown:  # SamplingParams(**kw) raises TypeError, which SGLang does not map to 400
                raise _HTTPError(500, b"Internal Server Error")
            self._validate_sampling(sp)
        n = int(sps[0].get("n", 1))
        if any(int(sp.get("n", 1)) != n for sp in sps):
            raise _value_error(
                "The parallel_sample_num should be the same for all samples in sample params."
            )

        def per_item(key: str, default: Any) -> list[Any]:
            v = body.get(key, default)
            if isinstance(v, list):
                if n > 1:
                    raise _value_error(f"list-valued {key} is not supported with n > 1")
                if len(v) != b:
                    raise _value_error(f"The length of {key} should match the batch size.")
                return v
            return [v] * b

        ret_lp, start_len, top_k = (
            per_item("return_logprob", False),
            per_item("logprob_start_len", -1),
            per_item("top_logprobs_num", 0),
        )
        rid = body.get("rid")
        if n > 1:
            rids = [uuid.uuid4().hex for _ in range(b * n)]
        elif is_list:
            if rid is None:
                rids = [uuid.uuid4().hex for _ in range(b)]
            elif isinstance(rid, str):
                rids = [f"{rid}_{i}" for i in range(b)]
            elif isinstance(rid, list) and len(rid) == b:
                rids = [str(r) for r in rid]
            else:
                raise _value_error(
                    "The specified rids length mismatch with the batch_size for batch processing."
                )
        else:
            if isinstance(rid, list):
                raise _value_error("The rid should be a string for a single request.")
            rids = [rid if rid is not None else uuid.uuid4().hex]
        for r in rids:
            if r in self._items:
                raise _value_error(f"Duplicate request ID detected: {r}")
        items = []
        for j in range(b * n):
            i = j // n
            prompt, sp = prompts[i], dict(sps[i])
            sp.setdefault("max_new_tokens", 128)
            p = len(prompt)
            if p >= self.context_length:
                raise _value_error(
                    f"The input ({p} tokens) is longer than the model's context length "
                    f"({self.context_length} tokens)."
                )
            if sp["max_new_tokens"] is None:
                sp["max_new_tokens"] = self.context_length - p - 1
            if p + sp["max_new_tokens"] >= self.context_length:
                m = sp["max_new_tokens"]
                raise _value_error(CONTEXT_MSG.format(C=self.context_length, T=p + m, P=p, N=m))
            if self.skip_tokenizer_init and (
                sp.get("stop") or sp.get("stop_regex") or sp.get("min_new_tokens")
            ):
                raise _value_error(
                    "stop strings and min_new_tokens need a tokenizer (--skip-tokenizer-init)"
                )
            k = int(start_len[i] if start_len[i] is not None else -1)
            if k > p:
                raise _value_error(
                    f"logprob_start_len ({k}) is larger than the input length ({p})."
                )
            items.append(
                _Item(
                    rid=rids[j],
                    index=j,
                    prompt=prompt,
                    sp=sp,
                    return_logprob=bool(ret_lp[i]),
                    logprob_start_len=k,
                    top_k=int(top_k[i] or 0),
                    text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                )
            )
        return items, is_list or n > 1, bool(body.get("stream", False))

    @staticmethod
    def _validate_sampling(sp: Mapping[str, Any]) -> None:
        t = sp.get("temperature", 1.0)
        if t is not None and t < 0:
            raise _value_error("temperature must be non-negative")
        top_p = sp.get("top_p", 1.0)
        if top_p is not None and not 0 < top_p <= 1:
            raise _value_error("top_p must be in (0, 1]")
        m = sp.get("max_new_tokens", 128)
        if m is not None and m < 0:
            raise _value_error("max_new_tokens must be at least 0")
        if int(sp.get("n", 1)) < 1:
            raise _value_error("n must be at least 1")

    async def _propose(self, it: _Item) -> tuple[list[tuple[int, float]], dict[str, Any] | None]:
        """The continuation the 'model' would produce, and its finish if it ends before a stop."""
        max_new = it.sp["max_new_tokens"]
        if self.backend is not None:
            stops = tuple(sorted(set(it.sp.get("stop_token_ids") or ()) | self.eos_token_ids))
            t = it.sp.get("temperature", 1.0)
            params = SamplingParams(
                max_new_tokens=max(1, max_new),
                temperature=1.0 if t is None else t,
                top_p=it.sp.get("top_p", 1.0),
                top_k=it.sp.get("top_k", -1),
                stop_token_ids=stops,
                seed=it.sp.get("sampling_seed"),
            )
            c: Completion = await self.backend.generate(list(it.prompt), params)
            toks = list(zip(c.token_ids, c.logprobs, strict=True))
            if c.finish_reason == "stop" and toks:
                return toks, {"type": "stop", "matched": toks[-1][0]}
            if c.finish_reason == "abort":
                return toks, dict(ABORT_RUNNING)
            return toks, {"type": "length", "length": max_new}
        out: Sequence[int | tuple[int, float]] = ()
        if callable(self.script):
            out = self.script(list(it.prompt))
        elif self.script is not None:
            best = -1
            for suffix, o in self.script.items():
                if len(suffix) > best and tuple(it.prompt[-len(suffix) :]) == tuple(suffix):
                    best, out = len(suffix), o
        toks = [
            (x, scripted_logprob(i, x)) if isinstance(x, int) else (int(x[0]), float(x[1]))
            for i, x in enumerate(out)
        ]
        toks += [
            (self.filler_token_id, scripted_logprob(i, self.filler_token_id))
            for i in range(len(toks), max_new)
        ]
        return toks, {"type": "length", "length": max_new}

    async def _run(
        self,
        it: _Item,
        *,
        abort_fault: bool = False,
        on_token: Callable[[list, Any], Any] | None = None,
    ) -> dict[str, Any]:
        """Decode `it` token by token (stops, aborts, pauses) and build its output object."""
        it.t0 = time.monotonic()
        sp = it.sp
        max_new = sp["max_new_tokens"]
        stops = self.eos_token_ids | set(sp.get("stop_token_ids") or ())
        stop_strs = sp.get("stop") or []
        stop_strs = [stop_strs] if isinstance(stop_strs, str) else list(stop_strs)
        min_new = int(sp.get("min_new_tokens") or 0)
        proposal, exhausted = (
            await self._propose(it) if max_new > 0 else ([], {"type": "length", "length": 0})
        )
        k = it.logprob_start_len
        if it.return_logprob and 0 <= k < len(it.prompt) - 1 and hasattr(self.backend, "score"):
            t = sp.get("temperature", 1.0)
            it.prompt_lps = list(
                await self.backend.score(it.prompt[: k + 1], it.prompt[k + 1 :], t or 1.0)
            )
        it.started = True
        out: list[tuple[int, float]] = []
        finish: dict[str, Any] | None = None
        text = ""
        for tid, lp in proposal:
            if self.faults.token_delay_s:
                await asyncio.sleep(self.faults.token_delay_s)
            while self.paused and not it.aborted:  # retract / in_place: no token until continue
                await self._resume.wait()
            if it.aborted:
                break
            out.append((tid, lp))  # decoded now, under the weights now loaded
            it.produced = len(out)
            if abort_fault and len(out) == 2:
                it.aborted = True
            if on_token is not None:
                await on_token(out, None)
            if tid in stops and not sp.get("ignore_eos") and len(out) >= min_new:
                finish = {"type": "stop", "matched": tid}
                break
            if stop_strs:
                text += self.tokenizer.decode_one(tid)
                hit = next((s for s in stop_strs if s and s in text), None)
                if hit is not None and len(out) >= min_new:
                    finish = {"type": "stop", "matched": hit}
                    break
            if len(out) >= max_new:
                finish = {"type": "length", "length": max_new}
                break
        if it.aborted:
            finish = dict(ABORT_RUNNING) if out or it.started else dict(ABORT_WAITING)
        elif finish is None:
            finish = exhausted
        if on_token is not None:
            await on_token(out, finish)
            return {}
        return self._output(it, out, finish, time.monotonic() - it.t0)

    def _output(
        self,
        it: _Item,
        out: list[tuple[int, float]],
        finish: dict[str, Any],
        latency: float,
        chunk_from: int = 0,
        final: bool = True,
    ) -> dict[str, Any]:
        """One output object in the shape of the configured SGLang version."""
        ids = [t for t, _ in out]
        legacy = self.legacy
        cached = max((_lcp(it.prompt, c) for c in self._cache), default=0)
        if final:
            self._cache.append(it.prompt + ids)
        meta: dict[str, Any] = {
            "id": it.rid,
            "finish_reason": finish if final else None,
            "prompt_tokens": len(it.prompt),
        }
        if legacy != "0.4.6":
            meta["weight_version"] = self.weight_version
        if legacy is None:
            meta["num_retractions"] = 0
        if it.return_logprob:
            meta["input_token_logprobs"] = self._input_logprobs(it)
            meta["output_token_logprobs"] = [
                [lp, t, self._tok_text(it, t)] for t, lp in out[chunk_from:]
            ]
            if legacy is None:
                meta["output_token_logprobs_length"] = len(out)
            if it.top_k > 0:
                meta["input_top_logprobs"] = (
                    [
                        None if e[0] is None else self._top(it, e[1], e[0])
                        for e in meta["input_token_logprobs"]
                    ]
                    if it.logprob_start_len >= 0
                    else []
                )
                meta["output_top_logprobs"] = [self._top(it, t, lp) for t, lp in out[chunk_from:]]
        if legacy is None:
            meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(out)
        meta["cached_tokens"] = cached
        if final:
            meta["e2e_latency"] = round(latency, 6)
            if legacy is None:
                meta["response_sent_to_client_ts"] = time.time()
        obj: dict[str, Any] = {}
        if not self.skip_tokenizer_init:
            obj["text"] = self._text(
                it, ids[chunk_from:] if chunk_from else ids, finish if final else None
            )
        if legacy != "0.4.6" or self.skip_tokenizer_init:
            obj["output_ids"] = ids[chunk_from:]
        obj["meta_info"] = meta
        return obj

    def _tok_text(self, it: _Item, tid: int) -> str | None:
        return (
            self.tokenizer.decode_one(tid)
            if it.text_in_logprobs and not self.skip_tokenizer_init
            else None
        )

    def _top(self, it: _Item, tid: int, lp: float) -> list[list[Any]]:
        alts = [[lp, tid, self._tok_text(it, tid)]]
        for j in range(1, it.top_k):
            alt = (tid + j) % 151936
            alts.append([round(lp - 1.0 - 0.2 * j, 6), alt, self._tok_text(it, alt)])
        return alts

    def _input_logprobs(self, it: _Item) -> list[list[Any]]:
        k = it.logprob_start_len
        if k < 0:
            return [] if self.legacy is None else [[None, it.prompt[-1], None]]
        values = it.prompt_lps
        if values is None:  # placeholder values in scripted mode; the backend's score() otherwise
            values = [round(-0.5 - 0.37 * j, 6) for j in range(len(it.prompt) - k - 1)]
        return [[None, it.prompt[k], self._tok_text(it, it.prompt[k])]] + [
            [v, t, self._tok_text(it, t)] for v, t in zip(values, it.prompt[k + 1 :], strict=True)
        ]

    def _text(self, it: _Item, ids: list[int], finish: dict[str, Any] | None) -> str:
        sp = it.sp
        ids = list(ids)
        if (
            finish is not None
            and not sp.get("no_stop_trim", False)
            and finish.get("type") == "stop"
            and isinstance(finish.get("matched"), int)
            and ids
            and ids[-1] == finish["matched"]
        ):
            ids = ids[:-1]
        special = set(self.tokenizer.special) | self.eos_token_ids
        if sp.get("skip_special_tokens", True):
            ids = [t for t in ids if t not in special]
        text = "".join(self.tokenizer.decode_one(t) for t in ids)
        if (
            finish is not None
            and not sp.get("no_stop_trim", False)
            and isinstance(finish.get("matched"), str)
        ):
            cut = text.find(finish["matched"])
            if cut >= 0:
                text = text[:cut]
        return text

    @staticmethod
    async def _sse_start(writer: asyncio.StreamWriter) -> Callable[[Any], Any]:
        """Send the headers of an SSE answer; returns `emit(obj_or_bytes)` for its events."""
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )

        async def emit(obj: Any) -> None:
            data = (
                b"data: "
                + (
                    obj
                    if isinstance(obj, bytes)
                    else json.dumps(obj, separators=(",", ":")).encode()
                )
                + b"\n\n"
            )
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        return emit

    @staticmethod
    async def _sse_end(writer: asyncio.StreamWriter) -> None:
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _stream_events(self, writer: asyncio.StreamWriter, events: list[Any]) -> None:
        emit = await self._sse_start(writer)
        for e in events:
            await emit(e)
        await self._sse_end(writer)

    async def _stream(
        self, items: list[_Item], is_list: bool, writer: asyncio.StreamWriter, *, abort_fault: bool
    ) -> None:
        """SSE: one `data:` event per token (the last one carries the finish), then `[DONE]`.
        Cumulative chunks by default, deltas with `incremental_streaming`. Each chunk is built
        when its token is decoded, so its `weight_version` is the one that decoded it."""
        emit = await self._sse_start(writer)

        def hook(it: _Item) -> Callable[..., Any]:
            sent, pending = 0, None  # tokens covered by sent chunks; the chunk held back

            async def on_token(out: list[tuple[int, float]], finish: dict[str, Any] | None) -> None:
                nonlocal sent, pending
                if finish is None:  # hold each chunk back one token: the last one becomes final
                    if pending is not None:
                        await emit(pending[1])
                        sent = pending[0]
                    frm = sent if self.incremental_streaming else 0
                    chunk = self._output(it, out, {}, 0.0, chunk_from=frm, final=False)
                    pending = (len(out), chunk | ({"index": it.index} if is_list else {}))
                    return
                frm = sent if self.incremental_streaming else 0
                obj = self._output(it, out, finish, time.monotonic() - it.t0, chunk_from=frm)
                await emit(obj | ({"index": it.index} if is_list else {}))

            return on_token

        await asyncio.gather(
            *(self._run(it, abort_fault=abort_fault, on_token=hook(it)) for it in items)
        )
        await emit(b"[DONE]")
        await self._sse_end(writer)


class _Sentinel:
    pass


_DROP, _STREAMED = _Sentinel(), _Sentinel()


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _join_group(
    addr: str, port: int, rank: int, world_size: int, group_name: str, backend: str
) -> Any:
    """Join the trainer's weight-update group the way SGLang's server does (a second, named
    process group next to any default group: rendezvous store + PrefixStore(group_name))."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=120)
    store, rank, world_size = next(
        rendezvous(f"tcp://{addr}:{port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _receive_broadcast(pg: Any, dtypes: list[str], shapes: list[list[int]]) -> list[Any]:
    import torch
    import torch.distributed as dist

    out = []
    for dt, shape in zip(dtypes, shapes, strict=True):
        dtype = getattr(torch, dt, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dt!r}")
        t = torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=0, group=pg)
        out.append(t)
    return out


class TinyModelBackend:
    """A model-backed backend for the fake server: a (tiny) transformers causal LM on CPU.

    Samples with temperature / top-k / top-p, returns logprobs of the temperature-scaled full
    distribution (SGLang's definition), scores prompts, and takes weight updates from a state dict
    (full or partial) or a safetensors directory. Stand-in until `LocalEngine` can back the fake.
    """

    def __init__(self, model: Any) -> None:
        self.model = model.eval()
        self.version: str | None = None

    @classmethod
    def from_pretrained(cls, path: str) -> TinyModelBackend:
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path))

    def _logits(self, ids: list[int]) -> Any:
        import torch

        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].float()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        import torch

        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        ids, out, lps = list(prompt_ids), [], []
        finish = "length"
        for _ in range(params.max_new_tokens):
            logits = self._logits(ids)[-1]
            if params.temperature == 0:
                logp = torch.log_softmax(logits, -1)
                tid = int(torch.argmax(logits))
            else:
                logp = torch.log_softmax(logits / params.temperature, -1)
                probs = logp.exp()
                if params.top_k > 0:
                    kth = torch.topk(probs, min(params.top_k, probs.numel())).values[-1]
                    probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
                if params.top_p < 1:
                    sp, si = torch.sort(probs, descending=True)
                    keep = torch.cumsum(sp, 0) - sp < params.top_p
                    mask = torch.zeros_like(probs, dtype=torch.bool)
                    mask[si[keep]] = True
                    probs = torch.where(mask, probs, torch.zeros_like(probs))
                tid = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
            out.append(tid)
            lps.append(float(logp[tid]))
            ids.append(tid)
            if tid in params.stop_token_ids:
                finish = "stop"
                break
        return Completion(out, lps, finish, weight_version=self.version)

    async def score(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        import torch

        ids = list(prompt_ids) + list(completion_ids)
        logp = torch.log_softmax(self._logits(ids)[:-1] / (temperature or 1.0), -1)
        pos = torch.arange(len(prompt_ids) - 1, len(ids) - 1)
        return logp[pos, torch.tensor(ids[len(prompt_ids) :])].tolist()

    async def update_weights(self, weights: Any, *, version: str) -> None:
        import torch

        if isinstance(weights, (str, os.PathLike)):
            from safetensors.torch import load_file

            files = sorted(f for f in os.listdir(weights) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {weights}")
            sd: dict[str, Any] = {}
            for f in files:
                sd |= load_file(os.path.join(weights, f))
        else:
            sd = dict(weights)
        own = self.model.state_dict()
        unknown = set(sd) - set(own)
        if unknown:
            raise KeyError(f"unknown parameter names: {sorted(unknown)[:5]}")
        with torch.no_grad():
            for k, v in sd.items():
                if tuple(v.shape) != tuple(own[k].shape):
                    raise ValueError(f"{k}: shape {tuple(v.shape)} != {tuple(own[k].shape)}")
                own[k].copy_(v.to(own[k].dtype))
        self.version = version

    def get_weight(self, name: str) -> Any:
        return self.model.state_dict()[name]


# -- running in another process ------------------------------------------------------------------


class FakeSGLangProcess:
    """Runs `python -m tests.fake_sglang` in a subprocess (for tests that need a second process,
    e.g. the gloo broadcast, and for the benchmark). Use as a context manager; `.url` is set once
    the server listens."""

    def __init__(
        self, *args: str, env: Mapping[str, str] | None = None, timeout_s: float = 120.0
    ) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fake_sglang", "--port", "0", *args],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            env={**os.environ, **(env or {}), "PYTHONPATH": root},
        )
        deadline = time.monotonic() + timeout_s
        self.url = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("FAKE_SGLANG_READY "):
                self.url = line.split()[1]
                break
        if not self.url:
            self.close()
            raise RuntimeError("fake SGLang subprocess did not start")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> FakeSGLangProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_fixture(**defaults: Any) -> Any:
    """A pytest fixture `server`: an async factory of started FakeSGLang servers (keyword arguments
    over `defaults`), all stopped after the test. A test module takes it by assignment:
    `server = server_fixture(vocab=VOCAB)`."""
    import pytest

    @pytest.fixture
    async def server() -> Any:
        servers: list[FakeSGLang] = []

        async def make(**kw: Any) -> FakeSGLang:
            s = FakeSGLang(**{**defaults, **kw})
            await s.start()
            servers.append(s)
            return s

        yield make
        for s in servers:
            await s.stop()

    return server


def engine_fixture(**defaults: Any) -> Any:
    """A pytest fixture `engine`: a factory of SGLangEngine clients for given server urls
    (keyword arguments over `defaults`), all closed after the test."""
    import pytest

    from agentgrpo.engine.sglang.client import SGLangEngine

    @pytest.fixture
    async def engine() -> Any:
        engines: list[SGLangEngine] = []

        def make(urls: list[str], **kw: Any) -> SGLangEngine:
            e = SGLangEngine(urls, **{**defaults, **kw})
            engines.append(e)
            return e

        yield make
        for e in engines:
            await e.aclose()

    return engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fake SGLang server (tests only)")
    ap.add_argument("--model-path", default="fake/Qwen2.5-0.5B-Instruct")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--backend", choices=["scripted", "model"], default="scripted")
    ap.add_argument("--output", default="19,151645", help="scripted output ids, comma separated")
    ap.add_argument("--eos", default="151645,151643")
    ap.add_argument("--start-delay", type=float, default=0.0)
    ap.add_argument(
        "--generate-delay", type=float, default=0.0, help="seconds added to every /generate"
    )
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--api-key-env", default=None, help="read --api-key from this variable")
    ap.add_argument("--calls-log", default=None, help="append control calls to this JSONL file")
    ap.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="as SGLang's flag: memory can be released",
    )
    args, _unknown = ap.parse_known_args(argv)  # real SGLang flags (from the launcher) are ignored
    backend = TinyModelBackend.from_pretrained(args.model_path) if args.backend == "model" else None
    output = [int(x) for x in args.output.split(",") if x]
    server = FakeSGLang(
        script=lambda prompt: output,
        backend=backend,
        eos_token_ids=[int(x) for x in args.eos.split(",") if x],
        start_delay_s=args.start_delay,
        context_length=args.context_length,
        model_path=args.model_path,
        api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
        calls_log=args.calls_log,
        memory_saver=args.enable_memory_saver,
    )

    server.faults.generate_delay_s = args.generate_delay

    async def serve() -> None:
        import signal

        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        url = await server.start(args.host, args.port)
        print(f"FAKE_SGLANG_READY {url}", flush=True)
        await stop.wait()
        await server.stop()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
