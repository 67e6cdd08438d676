"""Tools: typed Python functions the model can call.

`@tool` turns a plain (sync or async) function into a `Tool`: its JSON schema comes from the
signature (through pydantic) and its description from the docstring, so there is one source of
truth. Calling a tool validates the model's arguments first; every failure (bad arguments, the
tool raising) comes back as a `ToolError` whose message is meant for the model to read.

String annotations are evaluated in the function's module, and keys the signature does not name
are refused at every depth (docs/environments.md, "With tools").
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import os
import re
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pydantic

from agentgrpo.deadlines import start_wait
from agentgrpo.types import InfrastructureError

T = TypeVar("T")
# newer pydantic forbids extra keys for one validation at every depth (nested models included)
_EXTRA_PER_CALL = "extra" in inspect.signature(pydantic.BaseModel.model_validate).parameters


class ToolError(Exception):
    """A tool call that could not be completed; `str(err)` is shown to the model."""


def _doc_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {arg: description})."""
    doc = inspect.cleandoc(doc or "")
    arg_docs: dict[str, str] = {}
    m = re.search(r"^(Args|Arguments|Parameters):\s*$", doc, flags=re.MULTILINE)
    if not m:
        return doc.strip(), arg_docs
    description = doc[: m.start()].strip()
    current = None
    for line in doc[m.end() :].splitlines():
        if not line.strip():
            continue
        if not line.startswith((" ", "\t")):
            break  # next section (Returns:, Raises:, ...)
        item = re.match(r"\s+(\w+)\s*(\([^)]*\))?:\s*(.*)", line)
        if item and (current is None or len(line) - len(line.lstrip()) <= 4):
            current = item.group(1)
            arg_docs[current] = item.group(3).strip()
        elif current:
            arg_docs[current] += " " + line.strip()
    return description, arg_docs


class Tool:
    """A callable tool with a JSON schema. Create it with `@tool`, not directly."""

    def __init__(
        self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}", self.name):
            raise ValueError(
                f"tool name {self.name!r} must match [A-Za-z_][A-Za-z0-9_-]*, max 64 chars"
            )
        doc_description, arg_docs = _doc_parts(fn.__doc__)
        self.description = description or doc_description
        if not self.description:
            raise ValueError(
                f"tool {self.name!r} needs a description (a docstring): the model reads it"
            )
        try:
            sig = inspect.signature(fn, eval_str=True)
        except NameError as e:
            raise TypeError(
                f"tool {self.name!r}: an annotation names something undefined when @tool "
                f"runs ({e}); define or import it before the tool"
            ) from None
        fields: dict[str, Any] = {}
        params = list(sig.parameters.values())
        if params and params[0].name == "self":
            params = params[1:]
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(
                    f"tool {self.name!r}: *args/**kwargs cannot be described to the model"
                )
            if p.annotation is inspect.Parameter.empty:
                raise TypeError(f"tool {self.name!r}: parameter {p.name!r} needs a type annotation")
            default = ... if p.default is inspect.Parameter.empty else p.default
            fields[p.name] = (
                p.annotation,
                pydantic.Field(default, description=arg_docs.get(p.name)),
            )
        self.params_model = pydantic.create_model(
            f"{self.name}_args", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
        parameters = self.params_model.model_json_schema()
        parameters.pop("title", None)
        for prop in parameters.get("properties", {}).values():
            prop.pop("title", None)
        if _EXTRA_PER_CALL:  # say in the schema what validate() enforces
            for sub in parameters.get("$defs", {}).values():
                if sub.get("type") == "object" and "properties" in sub:
                    sub["additionalProperties"] = False
        parameters.setdefault("required", [])
        self.schema: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
            },
        }
        self.is_async = inspect.iscoroutinefunction(fn)
        self._bound_self: Any = None

    def __get__(self, obj: Any, objtype: Any = None) -> Tool:
        """Methods decorated with @tool bind like methods (so ToolEnv subclasses can use self)."""
        if obj is None:
            return self
        bound = object.__new__(Tool)
        bound.__dict__.update(self.__dict__)
        bound._bound_self = obj
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._bound_self is not None:
            return self.fn(self._bound_self, *args, **kwargs)
        return self.fn(*args, **kwargs)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check the model's arguments against the signature; raise ToolError naming the problem."""
        if not isinstance(arguments, dict):
            raise ToolError(
                f"arguments of {self.name} must be a JSON object, got {type(arguments).__name__}"
            )
        try:
            parsed = (
                self.params_model.model_validate(arguments, extra="forbid")
                if _EXTRA_PER_CALL
                else self.params_model.model_validate(arguments)
            )
        except pydantic.ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in err['loc']) or '(arguments)'}: {err['msg']}"
                for err in e.errors()
            )
            raise ToolError(f"invalid arguments for {self.name}: {problems}") from None
        return {k: getattr(parsed, k) for k in type(parsed).model_fields}

    async def acall(self, arguments: dict[str, Any]) -> str:
        """Validate, run (sync tools in a worker thread), and render the result as text.

        A sync-looking function that returns an awaitable (an async tool under a plain
        `functools.wraps` decorator) has it awaited here, on the event loop, as `call_env` does for
        env methods. Any exception raised by the tool body becomes a ToolError: tool code is user
        code called with model-chosen arguments, and its failure is information for the model, not
        a crash.
        """
        kwargs = self.validate(arguments)
        try:
            if self.is_async:
                result = await self(**kwargs)
            else:
                result = await to_user_thread(self, **kwargs)
                if inspect.isawaitable(result):
                    result = await result
        except (ToolError, InfrastructureError):
            raise  # infrastructure failures end the episode as unscorable; never shown to the model
        except Exception as e:  # noqa: BLE001 - the trust boundary: tool code with model arguments
            raise ToolError(f"{self.name} raised {type(e).__name__}: {e}") from e
        return render_result(result)


def render_result(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, pydantic.BaseModel):
        return result.model_dump_json()
    try:
        return json.dumps(result, ensure_ascii=False)
    except TypeError:
        return str(result)


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None
) -> Any:
    """Decorator: `@tool` or `@tool(name=..., description=...)`. See the module docstring.

    Example:
        >>> from agentgrpo.env.tool import tool
        >>> @tool
        ... def add(a: int, b: int) -> int:
        ...     '''Add two integers.
        ...
        ...     Args:
        ...         a: the first term
        ...         b: the second term
        ...     '''
        ...     return a + b
        >>> add.schema["function"]["parameters"]["required"]
        ['a', 'b']
        >>> add(a=2, b=3)
        5
    """
    if fn is None:
        return lambda f: Tool(f, name=name, description=description)
    return Tool(fn, name=name, description=description)


# ---------------------------------------------------------------------------------------------
# Worker threads for sync user code (env methods, tools, verifiers)

USER_THREADS = 256
"""Most sync user calls running at once (the size of the `agentgrpo-user` thread pool).

Not asyncio's default executor: that one has min(32, cpus + 4) threads (6 on a 2-core machine), so
with 32-256 trajectories in flight, sync steps, tools and verifiers that wait on I/O ran 6 at a
time (64 sync calls of 0.2 s took 2.2 s instead of 0.2 s), and it is shared with every library
that calls `asyncio.to_thread`. Sync user code mostly waits (HTTP, a sandbox, a subprocess,
math-verify's worker processes), so the pool is sized for rollout concurrency, not for cores: 256
covers the episodes of a large step, each with a call in flight. Threads are started only when
every existing one is busy and each costs little (a stack of virtual memory), so the bound costs
nothing until it is needed. CPU-bound sync code gains nothing from more threads (the GIL): write it
as a subprocess or a process pool call.
"""

STUCK_WARN_AT = USER_THREADS // 8
"""Warn (once per process) when this many abandoned calls still hold threads."""

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_stuck = 0
_warned = False


def _user_executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:  # created on first use: importing agentgrpo starts no threads
            _executor = ThreadPoolExecutor(USER_THREADS, thread_name_prefix="agentgrpo-user")
        return _executor


def _forget_in_child() -> None:
    # A forked child has none of the parent's threads, but a copied pool would count the idle ones
    # as available and queue work on them forever: the child makes its own pool on first use.
    global _executor, _stuck, _lock
    _executor, _stuck, _lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_in_child)


def stuck_user_calls() -> int:
    """Sync user calls whose caller gave up (a deadline passed) but that still run in their thread.

    A thread cannot be killed, so each holds one of the `USER_THREADS` until its code returns; when
    all are held, every later sync tool, env step and verifier waits for a free one.
    """
    return _stuck


def _released(_: Future) -> None:
    global _stuck
    with _lock:
        _stuck -= 1


def _abandoned(fut: Future, fn: Callable[..., Any]) -> None:
    global _stuck, _warned
    with _lock:
        _stuck += 1
        n = _stuck
        warn = n >= STUCK_WARN_AT and not _warned
        _warned = _warned or warn
    fut.add_done_callback(_released)  # runs at once if it has finished meanwhile
    if warn:
        name = getattr(fn, "__qualname__", None) or getattr(fn, "name", None) or repr(fn)
        warnings.warn(
            f"{n} sync calls of user code (the latest: {name}) overran their deadlines and still "
            f"hold worker threads ({USER_THREADS} in all); when all are held every sync tool, env "
            "step and verifier waits. Give blocking code its own timeout, or make it async.",
            RuntimeWarning,
            stacklevel=3,
        )


async def to_user_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run sync user code in the `agentgrpo-user` pool and await its result (like
    `asyncio.to_thread`, context variables included, but on a pool sized for rollouts: see
    `USER_THREADS`).

    When the caller is cancelled (a tool, turn or step deadline passed) a call still queued is
    dropped; one already running cannot be stopped: it finishes in its thread, its result is thrown
    away, and it counts in `stuck_user_calls()` until then.
    """
    ctx = contextvars.copy_context()
    work = functools.partial(fn, *args, **kwargs)
    stop_wait = start_wait()  # time queued for a free thread is not a tool's running time

    def run() -> T:
        stop_wait()
        return work()

    fut = _user_executor().submit(ctx.run, run)
    try:
        return await asyncio.wrap_future(fut)
    except asyncio.CancelledError:
        if not fut.done() and not fut.cancel():  # running: the thread goes on without us
            _abandoned(fut, fn)
        raise
    finally:
        stop_wait()  # a no-op once the thread has started
