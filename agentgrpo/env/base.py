"""Environments: Gymnasium envs whose observations and actions are chat messages.

One `Env` instance runs one trajectory: `reset(seed=..., options={"task": task})` returns the first
messages, `step(assistant_message)` returns `(new_messages, reward, terminated, truncated, info)`
(or an `EnvStep`), and the rollout asks the model for the next turn until the episode ends.
`reset` and `step` may be `async def`; sync ones run in a worker thread. A group's members are
reset with one task and seed, so `reset` seeds everything random with it, or the env declares
`stochastic = True`. Tasks come from `load_tasks(split, seed)` (by default `tasks_from_file`). A
returned value that breaks the contract ends that trajectory with ENV_ERROR, never the step;
`check_env` checks the whole contract. Verifiers stay apart: an env may declare a `rubric`,
whose reward replaces the env's own. docs/environments.md has the contract in full.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.metadata
import inspect
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import gymnasium

from agentgrpo.deadlines import run_charging_only_running_time
from agentgrpo.env.rubric import Rubric
from agentgrpo.env.spaces import MessageSpace, MessagesSpace, String  # noqa: F401 - re-exported
from agentgrpo.env.tasks import tasks_from_file
from agentgrpo.env.tool import Tool, ToolError, to_user_thread
from agentgrpo.types import EnvStep, Message, Task, ToolCall, ToolErrorKind


class Env(gymnasium.Env):
    """Base class of agentgrpo environments (a `gymnasium.Env` over chat messages).

    Override `step` (and `reset` if the first messages are not just the task's prompt). The
    default `reset` seeds `self.np_random`, stores the task in `self.task` and returns the task's
    prompt as messages. `step` returns Gymnasium's 5-tuple, or an `EnvStep` (which unpacks as
    one) to say why an ending step ends the episode or which tool calls it answered with an error;
    the framework reads no key of `info`.

    `stochastic`: False promises that `reset` and `step` are a function of (task, seed, actions),
    which GRPO relies on to compare the members of a group. Set it to True when they are not, and
    document what the seed still fixes.

    `rubric`: None, or a `Rubric` that scores every finished episode of a group after the group has
    ended (as in willccbb/verifiers): its weighted sum becomes the reward (`Score.reward`) and its
    verifiers' scores `Score.parts`. The rewards `step` returned stay the trajectory's own
    (`Trajectory.reward`, `Score.env_reward`), counted in the reward only through the `env_reward`
    verifier (`agentgrpo.env.rubric.env_reward`). A class attribute, or a property when it depends
    on the instance.

    Example (a plain env: one method; a tool env: see `ToolEnv`):
        >>> from agentgrpo.env.base import Env
        >>> from agentgrpo.types import Message, Task
        >>> class Echo(Env):
        ...     '''Reward 1 when the model repeats the task's answer.'''
        ...     def step(self, action):
        ...         ok = action.content.strip() == str(self.task.answer)
        ...         return [], float(ok), True, False, {}
        >>> env = Echo()
        >>> msgs, _ = env.reset(seed=0, options={"task": Task(id="1", prompt="Say 7", answer=7)})
        >>> env.step(Message(role="assistant", content="7"))[1]
        1.0
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    observation_space = MessagesSpace()
    action_space = MessageSpace()
    stochastic: ClassVar[bool] = False
    rubric: Rubric | None = None
    task: Task | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        rubric = cls.__dict__.get("rubric")
        if not (
            rubric is None or isinstance(rubric, Rubric | property | functools.cached_property)
        ):  # fail at import, not mid-run
            raise TypeError(
                f"{cls.__name__}.rubric must be an agentgrpo.env.rubric.Rubric or None, "
                f"got {type(rubric).__name__}"
            )

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is not None:
            if not isinstance(task, Task):
                raise TypeError(
                    f"options['task'] must be an agentgrpo Task, got {type(task).__name__}"
                )
            self.task = task
        if self.task is None:
            raise ValueError(
                f"{type(self).__name__}.reset needs a task: reset(options={{'task': Task(...)}})"
            )
        return self.task.prompt_messages(), {}

    def step(self, action: Message) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} must implement step(action)")

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI-style tool schemas shown to the model (none for a plain env)."""
        return []

    @classmethod
    def load_tasks(
        cls, split: str = "train", seed: int = 0, *, file: str | None = None, **kwargs: Any
    ) -> Sequence[Task]:
        """The tasks of a split: from a file (`env.tasks: {file: "data/{split}.jsonl"}` in a config;
        see `tasks_from_file`, which the other keyword arguments go to), or override it to
        generate them."""
        if file is not None:
            return tasks_from_file(file.format(split=split), split=split, **kwargs)
        raise NotImplementedError(
            f"{cls.__name__}.load_tasks is not implemented: give env.tasks.file "
            "(a JSONL file of tasks) or override load_tasks"
        )


class ToolEnv(Env):
    """An env whose model calls typed tools; tool dispatch is built in.

    Declare tools as `@tool` methods or list `@tool` functions in `tools`. Write `reward` or
    declare a `rubric` (and optionally `prompt`). `step` runs every tool call of the assistant
    message concurrently and returns one `tool` message per call; an assistant message without tool
    calls ends the episode and is scored by `reward(task, messages)` (0.0 by default when the env
    has a rubric, which scores the episode once its group has ended). An episode the rollout ends
    otherwise (max turns, max tokens) gets no `reward` call: a model that never gave its answer
    keeps 0.0 (tool steps reward nothing), minus the tool-error penalty; a rubric, by contrast,
    scores every scorable episode, cut ones included (its verifiers decide what a cut one earns).
    A call to an unknown tool, invalid arguments, a tool that raises or times out, or too many
    calls in one turn all produce an error tool message the model can react to, counted by
    `ToolErrorKind` in the returned `EnvStep.tool_errors`. The rollout config may override
    `tool_timeout_s` and `max_tool_calls_per_turn` (`set_tool_limits`). `tool_timeout_s` counts the
    time a call runs, not the time it waits for a worker thread, a sandbox slot, or anything its
    code marks with `agentgrpo.deadlines.waiting_for_capacity`: that wait is load, not the model's
    doing, and the turn, episode and step deadlines bound it (a TIMEOUT, unscorable).

    Example (one tool call, then the answer; `step` is async):
        >>> import asyncio
        >>> from agentgrpo.env.base import ToolEnv
        >>> from agentgrpo.env.tool import tool
        >>> from agentgrpo.types import Message, Task, ToolCall
        >>> class Multiply(ToolEnv):
        ...     system_prompt = "Use the tool, then give the number."
        ...     @tool
        ...     def multiply(self, a: int, b: int) -> int:
        ...         '''Multiply two integers.
        ...
        ...         Args:
        ...             a: the first factor
        ...             b: the second factor
        ...         '''
        ...         return a * b
        ...     def reward(self, task, messages):
        ...         return float(messages[-1].content.strip() == str(task.answer))
        >>> env = Multiply()
        >>> msgs, _ = env.reset(options={"task": Task(id="1", prompt="3*7?", answer=21)})
        >>> [m.role for m in msgs]
        ['system', 'user']
        >>> call = ToolCall(id="c1", name="multiply", arguments={"a": 3, "b": 7})
        >>> asyncio.run(env.step(Message(role="assistant", tool_calls=[call]))).messages
        [Message(role='tool', content='21', tool_calls=None, tool_call_id='c1', name='multiply')]
        >>> asyncio.run(env.step(Message(role="assistant", content="21"))).reward
        1.0
    """

    tools: ClassVar[Sequence[Tool]] = ()
    system_prompt: ClassVar[str | None] = None
    max_tool_calls_per_turn: ClassVar[int] = 8
    tool_timeout_s: ClassVar[float] = 30.0

    def prompt(self, task: Task) -> list[Message]:
        msgs = task.prompt_messages()
        if self.system_prompt and (not msgs or msgs[0].role != "system"):
            msgs = [Message(role="system", content=self.system_prompt), *msgs]
        return msgs

    def reward(self, task: Task, messages: list[Message]) -> float:
        if self.rubric is not None:
            return 0.0  # the rubric scores the episode (run_group); this is its `env_reward`
        raise NotImplementedError(
            f"{type(self).__name__} must implement reward(task, messages) or declare a rubric"
        )

    def get_tools(self) -> dict[str, Tool]:
        found: dict[str, Tool] = {}
        for t in self.tools:
            if not isinstance(t, Tool):
                raise TypeError(f"{type(self).__name__}.tools must hold @tool functions, got {t!r}")
            found[t.name] = t
        for klass in reversed(type(self).__mro__):
            for attr, value in vars(klass).items():
                if isinstance(value, Tool):
                    bound = getattr(self, attr)
                    found[bound.name] = bound
        return found

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.get_tools().values()]

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed, options=options)
        assert self.task is not None
        self.messages = self.prompt(self.task)
        return list(self.messages), {}

    async def step(self, action: Message) -> EnvStep:
        self.messages.append(action)
        calls = action.tool_calls or []
        if not calls:  # a sync reward (a math check, a sandbox call) runs in a worker thread
            reward = await call_env(self.reward, self.task, self.messages)
            return EnvStep([], float(reward), True, False)
        tools = self.get_tools()
        allowed, extra = (
            calls[: self.max_tool_calls_per_turn],
            calls[self.max_tool_calls_per_turn :],
        )
        results = list(await asyncio.gather(*(self._run_call(tools, c) for c in allowed)))
        results += [
            (
                c,
                f"Error: too many tool calls in one turn (at most {self.max_tool_calls_per_turn}); "
                "this call was not run",
                ToolErrorKind.TOO_MANY_CALLS,
            )
            for c in extra
        ]
        out = [
            Message(role="tool", content=text, tool_call_id=c.id or None, name=c.name)
            for c, text, _ in results
        ]
        self.messages.extend(out)
        errors = Counter(kind for _, _, kind in results if kind is not None)
        return EnvStep(out, 0.0, False, False, tool_errors=errors)

    def set_tool_limits(
        self, *, timeout_s: float | None = None, max_calls_per_turn: int | None = None
    ) -> None:
        """Override this instance's per-call deadline and calls-per-turn limit (None keeps the
        class's own value). The rollout calls it with the config's settings."""
        if timeout_s is not None:
            self.tool_timeout_s = timeout_s
        if max_calls_per_turn is not None:
            self.max_tool_calls_per_turn = max_calls_per_turn

    async def _run_call(
        self, tools: dict[str, Tool], call: ToolCall
    ) -> tuple[ToolCall, str, ToolErrorKind | None]:
        t = tools.get(call.name)
        if t is None:
            return (
                call,
                f"Error: unknown tool {call.name!r}; available: {sorted(tools)}",
                ToolErrorKind.UNKNOWN_TOOL,
            )
        try:
            t.validate(call.arguments)
        except ToolError as e:
            return call, f"Error: {e}", ToolErrorKind.INVALID_ARGUMENTS
        try:
            text, _ = await run_charging_only_running_time(
                t.acall(call.arguments), self.tool_timeout_s
            )
            return call, text, None
        except ToolError as e:
            return call, f"Error: {e}", ToolErrorKind.TOOL_FAILED
        except asyncio.TimeoutError:
            # A sync tool's thread cannot be killed: it runs on in the background, its result
            # unused.
            return (
                call,
                f"Error: {call.name} did not finish within {self.tool_timeout_s:g} s",
                ToolErrorKind.TOOL_TIMEOUT,
            )


# ---------------------------------------------------------------------------------------------
# Calling envs from the rollout (sync or async alike)


async def call_env(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await an async env method natively; run a sync one in a worker thread (`to_user_thread`)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await to_user_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def close_env(env: Env, timeout_s: float = 30.0) -> str | None:
    """Close an episode's env (its sync or async `close`), bounded by `timeout_s`; returns the
    problem as text when `close` raised or hung, else None. It runs in a finally block, so it is
    shielded from a cancellation of the episode: the env's resources go even then."""
    try:
        await asyncio.shield(asyncio.wait_for(call_env(env.close), timeout_s))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - env code is user code: its failure is reported
        return f"close raised {type(e).__name__}: {e}"
    return None


def env_rubric(env: Env) -> Rubric | None:
    """The env's rubric, checked (a property may return anything)."""
    rubric = env.rubric
    if not (rubric is None or isinstance(rubric, Rubric)):
        raise TypeError(
            f"{type(env).__name__}.rubric must be an agentgrpo.env.rubric.Rubric or None, "
            f"got {type(rubric).__name__}"
        )
    return rubric


def reset_messages(result: Any) -> list[Message]:
    """The first messages from what `env.reset` returned (user code): `(messages, info)` with a
    non-empty list of Message. Raises ValueError naming the problem, which the rollout turns into
    an ENV_ERROR trajectory."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(f"reset must return (messages, info), got {result!r:.200}")
    messages, info = result
    if not (
        isinstance(messages, list) and messages and all(isinstance(m, Message) for m in messages)
    ):
        hint = (
            "; OpenAI-style dicts convert with Message.from_dict"
            if isinstance(messages, list) and any(isinstance(m, dict) for m in messages)
            else ""
        )
        raise ValueError(
            f"reset's messages must be a non-empty list of Message, got {messages!r:.200}{hint}"
        )
    if not isinstance(info, dict):
        raise ValueError(f"reset's info must be a dict, got {type(info).__name__}")
    return list(messages)


def run_sync(value: Any) -> Any:
    """`value`, or its result when it is awaitable (run on a fresh event loop): an env method called
    outside the rollout's loop, by the checks, whether the env wrote it sync or async."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


# ---------------------------------------------------------------------------------------------
# Validation


class EnvCheckError(AssertionError):
    """An environment breaks the Env contract; the message lists every problem found."""


# ---------------------------------------------------------------------------------------------
# Registry

ENVS: dict[str, type[Env]] = {}

# Installed packages name their environments under this entry-point group, agentgrpo's own `envs/`
# among them (pyproject.toml: [project.entry-points."agentgrpo.envs"] name = "module:Class").
ENTRY_POINT_GROUP = "agentgrpo.envs"


def register_env(name: str, cls: type[Env] | None = None) -> Any:
    """Register an env class by name at run time (usable as `@register_env("name")`); a package
    that ships envs declares them as entry points instead (`ENTRY_POINT_GROUP`)."""

    def deco(c: type[Env]) -> type[Env]:
        if not (isinstance(c, type) and issubclass(c, Env)):
            raise TypeError(f"register_env({name!r}): {c!r} is not an Env subclass")
        ENVS[name] = c
        return c

    return deco(cls) if cls is not None else deco


def get_env_class(name: str) -> type[Env]:
    """`name` is a registered name, an entry point of `ENTRY_POINT_GROUP`, or `module:Class`.

    A module the import path does not have is looked for in the current directory too (appended
    to `sys.path`, so it never shadows an installed package), as `python -m` would find it: the
    `agentgrpo` command, unlike `python`, does not put the current directory on the path. A module
    that is still not found, a name that is not an Env class, or a name nothing registers is a
    ValueError saying so; an error raised while importing the user's module propagates as it is
    (it is their code).
    """
    if ":" in name:
        module, _, attr = name.partition(":")
        if module.endswith(".py"):
            raise ValueError(f"env {name!r}: name the module, not its file: {module[:-3]}:{attr}")
        try:
            mod = _import_user_module(module)
        except ModuleNotFoundError as e:
            if not _names_module(e, module):
                raise  # the user's module imports something that is not installed: their traceback
            raise ValueError(
                f"env {name!r}: no module named {e.name!r} (looked in the import path and in "
                f"the current directory {os.getcwd()}; set PYTHONPATH to its folder)"
            ) from None
        cls = getattr(mod, attr, None)
        if not (isinstance(cls, type) and issubclass(cls, Env)):
            raise ValueError(
                f"{name!r} does not name an agentgrpo Env class"
                + ("" if cls is not None else f" (module {module!r} has no {attr!r})")
            )
        return cls
    if name in ENVS:
        return ENVS[name]
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP).select(name=name)
    if not found:
        raise ValueError(
            f"unknown environment {name!r}; known: {known_env_names()} (or use "
            f"module:Class){_missing_entry_points()}"
        )
    entry = next(iter(found))
    cls = entry.load()
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ValueError(
            f"env {name!r}: entry point {entry.value!r} ({ENTRY_POINT_GROUP}) is "
            "not an agentgrpo Env class"
        )
    return cls


def known_env_names() -> list[str]:
    """The names `get_env_class` resolves without `module:Class`: registered and entry points."""
    return sorted(set(ENVS) | set(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP).names))


def _missing_entry_points() -> str:
    """Why agentgrpo's own envs may be missing from the names: the install predates the group,
    or agentgrpo runs from a source tree that was never installed."""
    try:
        dist = importlib.metadata.distribution("agentgrpo")
    except importlib.metadata.PackageNotFoundError:
        return (
            "; agentgrpo is not installed, so its own environments (entry points of "
            f"{ENTRY_POINT_GROUP}) are unknown: install it with pip install -e ."
        )
    if not any(e.group == ENTRY_POINT_GROUP for e in dist.entry_points):
        return (
            f"; the installed agentgrpo {dist.version} declares no {ENTRY_POINT_GROUP} entry "
            "points (its metadata predates them): reinstall with pip install -e ."
        )
    return ""


def _import_user_module(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if not _names_module(e, module) or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(module)


def _names_module(e: ModuleNotFoundError, module: str) -> bool:
    """Whether the module not found is `module` itself or a package above it."""
    return e.name is not None and (module == e.name or module.startswith(e.name + "."))
