"""Tools in a sandbox session, and `WorkspaceEnv`: the base of envs whose model works in one.

Each episode has its own session (`agentgrpo.verify.sandbox.Sandbox.session`): `reset` starts it
on a fork of the task's prepared workspace (closing the one before), `close` ends it (the rollout
closes every episode's env), so nothing of one episode reaches another. `reset`'s info holds
`workspace_checksum`, which the rollout keeps in the trajectory's `env_info`: members of a group
showing the same value started from the same bytes. Tools, as `@tool` methods (`tool_names` picks
the ones the model sees): `bash(command)`, `read_file(path)`, `write_file(path, content)`,
`replace_in_file(path, old, new)`. A session that fails raises an `InfrastructureError`
(the episode is unscorable); a spent episode budget is a tool error the model reads.

docs/environments.md ("Workspaces") walks through a subclass; `WorkspaceEnv` has an example.
"""

from __future__ import annotations

from typing import Any, ClassVar

from agentgrpo import Message, Task, ToolEnv, tool
from agentgrpo.env.tool import Tool, ToolError
from agentgrpo.verify.sandbox import ExecResult, Sandbox, adefault_sandbox, check_sandbox
from agentgrpo.verify.session import Session, SessionError, SessionLimits
from agentgrpo.verify.workspace import Workspace
from tools.python import format_result

TOOL_NAMES = ("bash", "read_file", "write_file", "replace_in_file")


def checked(res: ExecResult) -> ExecResult:
    """`res`, unless the sandbox failed it: then SessionError (the episode is unscorable; a
    reward read from a failed call would be a 0 that is not the model's)."""
    if res.status == "sandbox_error":
        raise SessionError(f"session call failed: {res.detail}")
    return res


def tool_message(res: ExecResult, max_chars: int) -> str:
    """A session call's result as the model reads it; a sandbox failure raises (unscorable)."""
    return format_result(checked(res), max_chars)


class WorkspaceEnv(ToolEnv):
    """A `ToolEnv` whose episodes each run in a sandbox session (see the module docstring).

    Subclasses write `workspace(task)` (the task's `Workspace`, or None for an empty one) and
    `reward` (or a rubric); `reward` may read the end state through `self.session`. Constructor:
    `sandbox` (default: the process-wide one), `limits` (a `SessionLimits` or its dict),
    `max_output_chars` (size bound of a tool message).

    Example:
        >>> class Touch(WorkspaceEnv):
        ...     tool_names = ("bash",)
        ...     async def reward(self, task, messages):
        ...         return float("done" in (await self.session.run("ls")).stdout)
        >>> [t["function"]["name"] for t in Touch().tool_schemas()]
        ['bash']
    """

    tool_names: ClassVar[tuple[str, ...]] = TOOL_NAMES

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        limits: SessionLimits | dict[str, Any] | None = None,
        max_output_chars: int = 4000,
    ) -> None:
        check_sandbox(sandbox, type(self).__name__, "session")
        self.sandbox = sandbox
        self.limits = (
            limits if isinstance(limits, SessionLimits) else SessionLimits(**(limits or {}))
        )
        if max_output_chars < 200:
            raise ValueError(f"max_output_chars must be at least 200, got {max_output_chars}")
        self.max_output_chars = max_output_chars
        self.session: Session | None = None
        self.get_tools()  # a `tool_names` that names no tool fails here, not mid-episode

    def workspace(self, task: Task) -> Workspace | None:
        """The task's workspace; by default `task.metadata["workspace"]` (a `Workspace` or its
        dict form; None: an empty workspace)."""
        spec = task.metadata.get("workspace")
        return None if spec is None else Workspace.model_validate(spec)

    def get_tools(self) -> dict[str, Tool]:
        tools = super().get_tools()
        unknown = set(self.tool_names) - set(tools)
        if unknown:
            raise ValueError(f"{type(self).__name__}.tool_names names no tool: {sorted(unknown)}")
        return {n: t for n, t in tools.items() if n in self.tool_names or n not in TOOL_NAMES}

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        messages, info = super().reset(seed=seed, options=options)
        previous, self.session = self.session, None
        if previous is not None:  # a second reset of one env: the old episode ends here
            await previous.close()
        assert self.task is not None
        sandbox = self.sandbox or await adefault_sandbox()
        self.session = await sandbox.session(self.workspace(self.task), limits=self.limits)
        return messages, {**info, "workspace_checksum": self.session.workspace_checksum}

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close_sync()

    async def fresh_fork(self, task: Task, limits: SessionLimits | None = None) -> Session:
        """A new session on a fresh fork of `task`'s workspace (as the episode started), for
        scoring the model's work where its other edits cannot reach; the caller closes it."""
        sandbox = self.sandbox or await adefault_sandbox()
        return await sandbox.session(self.workspace(task), limits=limits or self.limits)

    def live_session(self) -> Session:
        if self.session is None:
            raise SessionError(f"{type(self).__name__}: no session (reset the env first)")
        return self.session

    @tool
    async def bash(self, command: str) -> str:
        """Run a shell command in your workspace (bash; the working directory, variables and
        files persist between calls; no network).

        Args:
            command: the command line to run, e.g. "ls -la" or "python3 run_tests.py"
        """
        res = await self.live_session().run(command)
        return tool_message(res, self.max_output_chars)

    @tool
    async def read_file(self, path: str) -> str:
        """Read a text file of your workspace.

        Args:
            path: the file's path, relative to the workspace
        """
        text = await self.live_session().read(path)
        if len(text) > self.max_output_chars:
            cut = self.max_output_chars - 60
            return text[:cut] + f"\n... [{len(text) - cut} more characters not shown]"
        return text

    @tool
    async def write_file(self, path: str, content: str) -> str:
        """Write (create or replace) a text file of your workspace.

        Args:
            path: the file's path, relative to the workspace
            content: the whole new content of the file
        """
        await self.live_session().write(path, content)
        return f"wrote {len(content)} characters to {path}"

    @tool
    async def replace_in_file(self, path: str, old: str, new: str) -> str:
        """Replace one exact piece of text in a file of your workspace (it must occur once).

        Args:
            path: the file's path, relative to the workspace
            old: the exact text to replace, as it is in the file
            new: the text to put in its place
        """
        session = self.live_session()
        text = await session.read(path)
        count = text.count(old) if old else 0
        if count != 1:
            found = "does not occur" if count == 0 else f"occurs {count} times"
            raise ToolError(f"the text to replace {found} in {path}; give a unique, exact piece")
        await session.write(path, text.replace(old, new, 1))
        return f"replaced 1 occurrence in {path}"
