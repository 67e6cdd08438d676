"""MCP tools: a `ToolEnv` whose tools come from Model Context Protocol servers.

`MCPToolEnv` lists the tools of each server in `mcp_servers` (a command line over stdio, or a
streamable-HTTP URL) when an episode starts; they sit next to the env's own `@tool` functions and
a call takes the same path (`ToolEnv._run_call`): a bad name or arguments, an error result or a
call past `tool_timeout_s` becomes an error tool message. A server that cannot be reached, or
dies, raises `InfrastructureError`: the episode ends as ENV_ERROR, unscorable (reward NaN).

Decisions (docs/environments.md, "MCP tools", has the why and an example):
- one session per episode and server, opened in `reset` and closed in `close`; a stdio server is
  a fresh process per episode, under `_reaper.py` on Linux, so its state starts from nothing;
- the sessions live on one event loop of their own in a daemon thread (`agentgrpo-mcp`), since
  the `mcp` client's streams belong to the task that opened them;
- `mcp` is optional (`pip install agentgrpo[mcp]`), imported when a session opens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from agentgrpo.env.base import ToolEnv
from agentgrpo.env.tool import Tool, ToolError
from agentgrpo.types import InfrastructureError, Message

_REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")
_TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}")  # as for @tool (agentgrpo.env.tool.Tool)


class MCPServerError(InfrastructureError):
    """An MCP server could not be started, reached, or answered no longer (it died)."""


@dataclass(frozen=True)
class MCPServer:
    """Where an MCP server is: `MCPServer.stdio(command, *args)` or `MCPServer.http(url)`.

    `prefix`: when set, the server's tool `name` is shown to the model as `<prefix>_<name>` (two
    servers with a tool of the same name, or one that clashes with an `@tool`). `open_timeout_s`
    bounds starting the server and listing its tools; past it the episode is unscorable.
    `handshake`: "legacy" (the default) opens with MCP's `initialize` handshake, which servers
    built on the 1.x SDK and the dual-era 2.x servers both answer; "auto" is the 2.x client's
    default, a `server/discover` probe first, which a 1.x server answers with a long validation
    error on its stderr before the client falls back; a protocol version string (a server that
    speaks only the 2026 protocol) adopts that version without a handshake.
    """

    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    cwd: str | None = None
    url: str | None = None
    prefix: str = ""
    open_timeout_s: float = 60.0
    handshake: str = "legacy"

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError(
                "an MCPServer has a command (MCPServer.stdio) or a url (MCPServer.http)"
            )
        if self.open_timeout_s <= 0:
            raise ValueError(f"open_timeout_s must be positive, got {self.open_timeout_s}")
        if not (
            self.handshake in ("legacy", "auto")
            or re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(self.handshake))
        ):
            raise ValueError(
                f"handshake must be 'legacy', 'auto' or a protocol version, got {self.handshake!r}"
            )

    @classmethod
    def stdio(
        cls,
        command: str,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        prefix: str = "",
        open_timeout_s: float = 60.0,
        handshake: str = "legacy",
    ) -> MCPServer:
        """A server started as `command *args` and spoken to over its stdin and stdout (its
        stderr stays the trainer's). `env` adds variables to the `mcp` package's default
        environment (a few safe ones such as PATH and HOME, not the trainer's whole environment)."""
        return cls(
            command=command,
            args=tuple(args),
            env=env,
            cwd=cwd,
            prefix=prefix,
            open_timeout_s=open_timeout_s,
            handshake=handshake,
        )

    @classmethod
    def http(
        cls,
        url: str,
        *,
        prefix: str = "",
        open_timeout_s: float = 60.0,
        handshake: str = "legacy",
    ) -> MCPServer:
        """A server already running at a streamable-HTTP endpoint (e.g. http://host:8000/mcp)."""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"MCPServer.http needs an http:// or https:// URL, got {url!r}")
        return cls(url=url, prefix=prefix, open_timeout_s=open_timeout_s, handshake=handshake)

    def describe(self) -> str:
        return self.url or " ".join([self.command or "", *self.args])


class MCPToolEnv(ToolEnv):
    """A `ToolEnv` that adds the tools of the MCP servers in `mcp_servers` (see the module
    docstring). A subclass that overrides `reset` calls `super().reset(...)` (it opens the
    sessions; it blocks until the servers answer, so an `async def reset` stalls its event loop
    meanwhile) and one that overrides `close` calls `super().close()`.
    """

    mcp_servers: ClassVar[Sequence[MCPServer]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        bad = [s for s in cls.__dict__.get("mcp_servers", ()) if not isinstance(s, MCPServer)]
        if bad:  # fail at import, not in every episode
            raise TypeError(
                f"{cls.__name__}.mcp_servers must hold MCPServer.stdio(...) or "
                f"MCPServer.http(...), got {bad[0]!r}"
            )

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        with self._mcp_lock():
            self._close_sessions()  # a second reset of one env starts the servers afresh
            # all servers start at once; kept before they answer, so close() ends every one
            self._mcp_sessions = [_Session.start(server) for server in self.mcp_servers]
            for session in self._mcp_sessions:
                session.wait_open()
            self._mcp_tools = self._list_tools(self._mcp_sessions)
        return super().reset(seed=seed, options=options)

    def get_tools(self) -> dict[str, Tool]:
        found = super().get_tools()
        for name, t in getattr(self, "_mcp_tools", {}).items():
            if name in found:
                raise ValueError(
                    f"{type(self).__name__}: the MCP tool {name!r} ({t.server.describe()}) "
                    "has the name of an @tool; give its MCPServer a prefix"
                )
            found[name] = t
        return found

    def close(self) -> None:
        with self._mcp_lock():
            self._close_sessions()
        super().close()

    def _mcp_lock(self) -> threading.Lock:
        # close() may come while reset() still opens sessions (a reset past its deadline goes on
        # in its worker thread): it waits for them, so none is left running.
        lock = self.__dict__.get("_mcp_lock_")
        if lock is None:
            lock = self.__dict__.setdefault("_mcp_lock_", threading.Lock())
        return lock

    def _list_tools(self, sessions: list[_Session]) -> dict[str, MCPTool]:
        tools: dict[str, MCPTool] = {}
        for session in sessions:
            for t in session.tools:
                if t.name in tools:
                    raise ValueError(
                        f"{type(self).__name__}: two MCP servers have a tool {t.name!r} "
                        f"({tools[t.name].server.describe()}, {t.server.describe()}); "
                        "give one a prefix"
                    )
                tools[t.name] = t
        return tools

    def _close_sessions(self) -> None:
        sessions, self._mcp_sessions, self._mcp_tools = getattr(self, "_mcp_sessions", []), [], {}
        problems = [p for p in (s.close() for s in sessions) if p]
        if problems:
            raise MCPServerError("closing MCP sessions: " + "; ".join(problems))


class MCPTool(Tool):
    """One tool of an MCP server, called through the env's session. Built by `MCPToolEnv`."""

    def __init__(self, session: _Session, remote: Any) -> None:  # not Tool's: no function
        import jsonschema  # a dependency of `mcp`

        server = session.server
        self.session, self.server, self.remote_name = session, server, remote.name
        self.name = f"{server.prefix}_{remote.name}" if server.prefix else remote.name
        self.description = remote.description or getattr(remote, "title", None) or ""
        parameters = {k: v for k, v in dict(remote.input_schema or {}).items() if k != "title"}
        parameters.setdefault("type", "object")
        for prop in parameters.get("properties", {}).values():
            if isinstance(prop, dict):
                prop.pop("title", None)
        if "properties" in parameters:
            # as for @tool, a key the tool does not name is an invalid-arguments event, not
            # silently dropped by the server; the schema says so to the model
            parameters.setdefault("additionalProperties", False)
        if not _TOOL_NAME.fullmatch(self.name):
            raise ValueError(
                f"MCP tool {self.name!r} of {server.describe()}: a tool name must match "
                "[A-Za-z_][A-Za-z0-9_-]*, at most 64 characters"
            )
        try:
            checker = jsonschema.validators.validator_for(parameters)
            checker.check_schema(parameters)
        except jsonschema.SchemaError as e:
            raise ValueError(
                f"MCP tool {self.name!r} of {server.describe()}: its input schema is "
                f"not a valid JSON schema ({e.message})"
            ) from None
        self._checker = checker(parameters)
        parameters.setdefault("required", [])
        self.schema = {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
            },
        }
        self.is_async = True
        self._bound_self = None

    def __get__(self, obj: Any, objtype: Any = None) -> MCPTool:
        return self

    def __call__(self, **arguments: Any) -> Any:
        return self.acall(arguments)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check the model's arguments against the server's input schema (ToolError naming each
        problem), before anything is sent."""
        if not isinstance(arguments, dict):
            raise ToolError(
                f"arguments of {self.name} must be a JSON object, got {type(arguments).__name__}"
            )
        errors = sorted(
            self._checker.iter_errors(arguments), key=lambda e: [str(x) for x in e.absolute_path]
        )
        if errors:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in e.absolute_path) or '(arguments)'}: {e.message}"
                for e in errors
            )
            raise ToolError(f"invalid arguments for {self.name}: {problems}")
        return arguments

    async def acall(self, arguments: dict[str, Any]) -> str:
        """Validate, call the server, and render its answer as text; a result the server marks as
        an error is a ToolError, a lost connection an `MCPServerError` (unscorable)."""
        self.validate(arguments)
        result = await self.session.call(self.remote_name, arguments)
        text = render_content(result)
        if result.is_error:
            raise ToolError(text or f"{self.name} failed (the server gave no message)")
        return text


def render_content(result: Any) -> str:
    """The text the model reads from a `CallToolResult`: its text parts joined by newlines, the
    structured content as JSON when there is no text; other parts (images, audio, resources) are
    named, since the model reads text only."""
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", "?")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(getattr(block, "resource", None), "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind} content not shown: only text reaches the model]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Sessions, on the MCP event loop


class _Session:
    """One open connection to one server, held by a task on the MCP loop until `close`."""

    def __init__(self, server: MCPServer) -> None:
        self.server = server
        self.client: Any = None
        self.tools: list[MCPTool] = []
        self._opened: concurrent.futures.Future = concurrent.futures.Future()  # the tool listing
        self._held: concurrent.futures.Future | None = None  # done once the task has unwound
        self._scope: Any = None  # the anyio.CancelScope of the task, once it has begun
        self._stop: asyncio.Event | None = None
        self._cancelled = False
        self._started_at = 0.0

    @classmethod
    def start(cls, server: MCPServer) -> _Session:
        """Start the server (stdio) or connect (HTTP) and list its tools, on the MCP loop;
        `wait_open` waits for it."""
        session = cls(server)
        session._started_at = time.monotonic()
        session._held = asyncio.run_coroutine_threadsafe(session._hold(), _mcp_loop())
        return session

    def wait_open(self) -> None:
        """Wait until the tools are listed; MCPServerError when opening failed or took longer
        than the server's `open_timeout_s` (counted from `start`)."""
        server = self.server
        left = self._started_at + server.open_timeout_s - time.monotonic()
        try:
            listing = self._opened.result(max(left, 0.0))
        except concurrent.futures.TimeoutError:
            self.close()
            raise MCPServerError(
                f"MCP server {server.describe()} did not answer within {server.open_timeout_s:g} s"
            ) from None
        except Exception as e:
            self.close()
            raise MCPServerError(
                f"MCP server {server.describe()} failed to open: {type(e).__name__}: {e}"
            ) from e
        self.tools = [MCPTool(self, remote) for remote in listing]

    async def _hold(self) -> None:
        import anyio  # with `mcp` (the optional dependency), imported when a session opens
        from mcp import Client

        self._stop = asyncio.Event()
        try:
            # anyio's own cancellation (not Task.cancel, which can cut short the shielded
            # shutdown of `mcp`'s stdio transport and leave the server process behind)
            with anyio.CancelScope() as self._scope:
                if self._cancelled:  # closed before this task began
                    self._scope.cancel()
                async with Client(self._target(), mode=self.server.handshake) as client:
                    self.client = client
                    listing, cursor = [], None
                    while True:
                        page = await client.list_tools(cursor=cursor)
                        listing += page.tools
                        cursor = page.next_cursor
                        if not cursor:
                            break
                    self._opened.set_result(listing)
                    await self._stop.wait()
        except Exception as e:
            if not self._opened.done():
                self._opened.set_exception(e)
            raise
        finally:
            self.client = None
            if not self._opened.done():
                self._opened.set_exception(MCPServerError("closed while opening"))

    def _target(self) -> Any:
        if self.server.url is not None:
            return self.server.url
        from mcp.client.stdio import StdioServerParameters

        command, args = self.server.command, list(self.server.args)
        if sys.platform.startswith("linux"):  # none of the server's processes outlives it
            command, args = sys.executable, ["-I", _REAPER, command, *args]
        return StdioServerParameters(
            command=command, args=args, env=self.server.env, cwd=self.server.cwd
        )

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """Call a tool on the MCP loop; cancelling this await cancels the call there."""
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._call(name, arguments), _mcp_loop())
        )

    async def _call(self, name: str, arguments: dict[str, Any]) -> Any:
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        client = self.client
        if client is None:
            raise MCPServerError(f"MCP server {self.server.describe()}: the session has ended")
        try:
            return await client.call_tool(name, arguments)
        except MCPError as e:
            if e.error.code == CONNECTION_CLOSED:
                raise MCPServerError(
                    f"MCP server {self.server.describe()} went away during {name}: {e}"
                ) from e
            # a JSON-RPC error answering the call (bad parameters, an unknown tool, an internal
            # error of the tool): the server is there and said why; the model reads it
            raise ToolError(f"{name}: {e}") from e
        except (OSError, EOFError) as e:  # the transport (pipe, socket) broke
            raise MCPServerError(
                f"MCP server {self.server.describe()} failed during {name}: {type(e).__name__}: {e}"
            ) from e
        except Exception as e:  # noqa: BLE001 - anyio's closed/broken streams, httpx's errors...
            if type(e).__module__.split(".")[0] in ("anyio", "httpx", "httpx2", "httpcore"):
                raise MCPServerError(
                    f"MCP server {self.server.describe()} failed during {name}: "
                    f"{type(e).__name__}: {e}"
                ) from e
            raise

    def close(self) -> str | None:
        """End the session and wait until it has (a stdio server's process is gone then); the
        problem as text, else None."""
        held, self._held = self._held, None
        if held is None:
            return None
        _mcp_loop().call_soon_threadsafe(self._end)
        try:
            held.result(CLOSE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            return f"{self.server.describe()}: did not close within {CLOSE_TIMEOUT_S:g} s"
        except Exception as e:  # noqa: BLE001 - reported to close's caller, which notes it
            if self.tools:  # one that never opened has been reported by wait_open()
                return f"{self.server.describe()}: {type(e).__name__}: {e}"
        return None

    def _end(self) -> None:
        """On the MCP loop: an orderly exit once open, a cancellation while opening."""
        if self._scope is None:
            self._cancelled = True  # the task has not begun: it ends at once when it does
        elif self._opened.done() and self._stop is not None:
            self._stop.set()
        else:
            self._scope.cancel()


CLOSE_TIMEOUT_S = 15.0
"""How long `close` waits for a session to end: `mcp` gives a stdio server 2 s to exit once its
stdin closes, then SIGTERM, then SIGKILL, each after 2 s more."""


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _mcp_loop() -> asyncio.AbstractEventLoop:
    """The event loop every MCP session of this process lives on (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="agentgrpo-mcp", daemon=True).start()
            _loop = loop
        return _loop


def _forget_in_child() -> None:
    global _loop, _loop_lock
    _loop, _loop_lock = (
        None,
        threading.Lock(),
    )  # a forked child has no loop thread: it starts its own


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_in_child)
