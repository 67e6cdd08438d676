"""Meta's OpenEnv environments: an env server (OpenEnv's `create_app`) reached by URL or started
here, played over its session protocol: `env: {name: openenv, kwargs: {app: "pkg.server:app"}}`,
or `kwargs: {url: "http://host:8000"}`.

Per episode one WebSocket session (`/ws`: OpenEnv's HTTP `/reset` and `/step` make a fresh env per
request, so they cannot carry an episode). `reset` sends the task's seed and the observation
becomes the first user message; each assistant turn becomes an action, each observation the next
user message, and the step's reward and `done` come back as they are. An action the server's
schema rejects is the model's doing (`parse_error`, reward 0); any other failure (server down, a
step that raised there, a broken reply) makes the episode unscorable (NaN). Field mapping, a
server started here, capacity: docs/environments.md, "OpenEnv environments".
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from agentgrpo import Env, EnvStep, Message, StopReason, Task
from agentgrpo.types import InfrastructureError


class OpenEnvError(InfrastructureError):
    """The OpenEnv server failed (unreachable, a step that raised there, a broken reply)."""


class OpenEnvRefused(Exception):
    """The server rejected the action (its schema): the model's doing, not infrastructure."""


class _Server:
    """An env server this process started: `python -m uvicorn APP` on a free local port."""

    def __init__(self, app: str, cwd: str | None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
        # its output to a file, not a pipe: a pipe nobody reads fills up and blocks the server
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [*cmd, "--log-level", "warning"],
            cwd=cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our signals (a Ctrl-C) are not its
        )
        self.app = app

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def died(self) -> str | None:
        if self.proc.poll() is None:
            return None
        self.log.seek(0)
        err = self.log.read().decode(errors="replace")[-2000:].strip()
        return f"the server {self.app!r} exited with {self.proc.returncode}: {err}"


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _session_loop() -> asyncio.AbstractEventLoop:
    """The event loop every OpenEnv session of this process lives on (a daemon thread, started
    on first use): the rollout resets, steps and closes an env from different tasks, and
    `check_env` runs each call under its own `asyncio.run`, while a WebSocket belongs to a loop."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(
                target=_loop.run_forever, name="agentgrpo-openenv", daemon=True
            ).start()
        return _loop


def _forget_loop_in_child() -> None:
    global _loop, _loop_lock
    _loop, _loop_lock = None, threading.Lock()  # a forked child has no loop thread


os.register_at_fork(after_in_child=_forget_loop_in_child)


async def _on_session_loop(coro: Any) -> Any:
    """Await `coro` on the sessions' loop; cancelling this await cancels it there."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, _session_loop()))


_servers: dict[tuple[str, str | None], _Server] = {}
_action_fields: dict[str, list[str]] = {}  # server URL -> its action schema's string fields
_servers_lock = threading.Lock()


@atexit.register
def _stop_servers() -> None:
    for server in _servers.values():
        server.stop()


def local_server(app: str, cwd: str | None = None) -> _Server:
    """The server of `app` this process runs (started on first use, stopped at exit)."""
    with _servers_lock:
        key = (app, cwd)
        if key not in _servers or _servers[key].died():
            _servers[key] = _Server(app, cwd)
        return _servers[key]


async def _wait_healthy(url: str, timeout_s: float, server: _Server | None) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass  # not up yet
            if server is not None and (why := server.died()):
                raise OpenEnvError(why)
            if time.monotonic() > deadline:
                raise OpenEnvError(f"the OpenEnv server at {url} was not healthy in {timeout_s} s")
            await asyncio.sleep(0.2)


async def _schema(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/schema", timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                raise OpenEnvError(f"GET {url}/schema answered {r.status}")
            return await r.json()


def string_fields(schema: dict[str, Any]) -> list[str]:
    """The string properties of a JSON schema (OpenEnv's `metadata` aside)."""
    props = schema.get("properties", {})
    return [k for k, v in props.items() if k != "metadata" and v.get("type") == "string"]


class _Session:
    """One OpenEnv session over its WebSocket: reset, step, close."""

    def __init__(self, url: str) -> None:
        self.ws_url = "ws" + url.removeprefix("http") + "/ws"
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None

    async def open_and_reset(self, data: dict[str, Any]) -> dict[str, Any]:
        """Connect and reset; a server at capacity is asked again until it has room."""
        delay = 0.05
        while True:
            await self.close()
            self.http = aiohttp.ClientSession()
            try:
                self.ws = await self.http.ws_connect(self.ws_url, max_msg_size=100 << 20)
            except (aiohttp.ClientError, OSError) as e:
                raise OpenEnvError(f"cannot reach the OpenEnv server at {self.ws_url}: {e}") from e
            reply = await self.send("reset", data, capacity_ok=True)
            if reply is not None:
                return reply
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def send(
        self, kind: str, data: dict[str, Any], *, capacity_ok: bool = False
    ) -> dict[str, Any] | None:
        assert self.ws is not None
        try:
            await self.ws.send_str(json.dumps({"type": kind, "data": data}))
            msg = await self.ws.receive()
        except (aiohttp.ClientError, OSError, RuntimeError) as e:
            raise OpenEnvError(f"the OpenEnv session broke during {kind}: {e}") from e
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise OpenEnvError(f"the OpenEnv server closed the session during {kind} ({msg.type})")
        try:
            reply = json.loads(msg.data)
        except json.JSONDecodeError as e:
            raise OpenEnvError(f"the OpenEnv server's {kind} reply is not JSON: {e}") from e
        if reply.get("type") == "error":
            err = reply.get("data") or {}
            code = err.get("code")
            if code == "CAPACITY_REACHED" and capacity_ok:
                return None
            if code == "VALIDATION_ERROR" and kind == "step":
                raise OpenEnvRefused(json.dumps(err.get("errors", err.get("message")))[:1000])
            raise OpenEnvError(f"the OpenEnv server's {kind} failed ({code}): {err.get('message')}")
        data = reply.get("data")
        if reply.get("type") != "observation" or not isinstance(data, dict):
            raise OpenEnvError(f"the OpenEnv server's {kind} reply is not an observation: {reply}")
        return data

    async def close(self) -> None:
        if self.ws is not None and not self.ws.closed:
            try:
                await self.ws.send_str(json.dumps({"type": "close"}))
            except (aiohttp.ClientError, OSError, RuntimeError):
                pass  # closing anyway
            await self.ws.close()
        if self.http is not None:
            await self.http.close()
        self.ws = self.http = None


class OpenEnvEnv(Env):
    """An OpenEnv environment server's episode, as chat.

    Constructor: `url` (a running server) or `app` (`module:app` served here, from `cwd`),
    `action_key` / `observation_key` (the action field the model's text fills, the observation
    field shown to it; default: the one string field of each schema), `system_prompt`,
    `start_timeout_s` (how long a server may take to become healthy), `stochastic` (True when the
    server's reset does not honour the seed).

    Example:
        >>> env = OpenEnvEnv(url="http://127.0.0.1:8000")  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str | None = None,
        app: str | None = None,
        cwd: str | None = None,
        action_key: str | None = None,
        observation_key: str | None = None,
        system_prompt: str | None = None,
        start_timeout_s: float = 60.0,
        stochastic: bool = False,
    ) -> None:
        if (url is None) == (app is None):
            raise ValueError("OpenEnvEnv: give exactly one of url (a running server) or app")
        self.url, self.app, self.cwd = url and url.rstrip("/"), app, cwd
        self.action_key, self.observation_key = action_key, observation_key
        self.system_prompt, self.start_timeout_s = system_prompt, start_timeout_s
        self.stochastic = stochastic  # type: ignore[misc]  # the instance's own answer
        self.session: _Session | None = None

    async def _connect(self) -> str:
        """The server's URL, once it is healthy, and the action field (both read once per
        server and process)."""
        server = None
        if self.app is not None:
            server = local_server(self.app, self.cwd)
            self.url = server.url
        assert self.url is not None
        if self.url not in _action_fields:
            await _wait_healthy(self.url, self.start_timeout_s, server)
            _action_fields[self.url] = string_fields((await _schema(self.url)).get("action", {}))
        if self.action_key is None:
            found = _action_fields[self.url]
            if len(found) != 1:
                raise ValueError(
                    f"OpenEnvEnv: the action schema's string fields are {found}; name the one "
                    "the model's text fills with env.kwargs.action_key"
                )
            self.action_key = found[0]
        return self.url

    def _messages(self, data: dict[str, Any]) -> list[Message]:
        obs = data.get("observation") or {}
        key = self.observation_key
        if key is None:
            strings = [k for k, v in obs.items() if isinstance(v, str)]
            key = strings[0] if len(strings) == 1 else None
        text = obs.get(key) if key is not None else json.dumps(obs, sort_keys=True)
        if not isinstance(text, str):
            raise OpenEnvError(f"the observation has no string field {key!r}: {obs}")
        return [Message(role="user", content=text)]

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed, options=options)
        assert self.task is not None
        url = await _on_session_loop(self._connect())
        data = {**self.task.metadata.get("reset", {})}
        task_seed = self.task.metadata.get("seed")
        if task_seed is not None or seed is not None:
            data["seed"] = task_seed if task_seed is not None else seed
        await self.close()
        self.session = _Session(url)
        first = await _on_session_loop(self.session.open_and_reset(data))
        msgs = self._messages(first)
        if self.system_prompt:
            msgs.insert(0, Message(role="system", content=self.system_prompt))
        return msgs, {}

    async def step(self, action: Message) -> EnvStep:
        if self.session is None:
            raise OpenEnvError("step before reset: no OpenEnv session")
        try:
            data = await _on_session_loop(
                self.session.send("step", {self.action_key: action.content})
            )
        except OpenEnvRefused as e:
            info = {"refused": str(e)}
            return EnvStep([], 0.0, True, False, info, stop_reason=StopReason.PARSE_ERROR)
        assert data is not None
        reward, done = data.get("reward"), bool(data.get("done"))
        if reward is not None and not isinstance(reward, int | float):
            raise OpenEnvError(f"the server's reward is not a number: {reward!r}")
        return EnvStep([] if done else self._messages(data), float(reward or 0.0), done, False)

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await _on_session_loop(session.close())

    @classmethod
    def load_tasks(
        cls,
        split: str = "train",
        seed: int = 0,
        *,
        n: int = 1000,
        reset: dict[str, Any] | None = None,
    ) -> Sequence[Task]:
        """`n` episodes of `split`, each a reset seed of its own (train and eval seeds drawn from
        separate streams, so the splits do not share a start state when the server honours seeds)
        and `reset`: further arguments of the server's reset (its difficulty, a level, ...)."""
        if split not in ("train", "eval"):
            raise ValueError(
                f"OpenEnvEnv.load_tasks: split must be 'train' or 'eval', got {split!r}"
            )
        rng = random.Random(f"openenv/{split}/{seed}")
        return [
            Task(
                id=f"openenv-{split}-{seed}-{i}",
                prompt="",
                metadata={"seed": rng.randrange(2**31), "reset": dict(reset or {})},
            )
            for i in range(n)
        ]
