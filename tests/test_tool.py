import asyncio
import contextvars
import importlib
import threading
import time

import pytest

from agentgrpo.env.tool import Tool, ToolError, stuck_user_calls, to_user_thread, tool

tool_module = importlib.import_module(
    "agentgrpo.env.tool"
)  # `agentgrpo.env.tool` is also the decorator


@tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second
            term, wrapped
    """
    return a + b


def test_schema_comes_from_signature_and_docstring():
    fn = add.schema["function"]
    assert fn["name"] == "add"
    assert fn["description"] == "Add two integers."
    props = fn["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "the first term"}
    assert props["b"]["default"] == 2 and props["b"]["description"] == "the second term, wrapped"
    assert fn["parameters"]["required"] == ["a"]
    assert fn["parameters"]["additionalProperties"] is False


def test_call_validates_and_renders():
    assert asyncio.run(add.acall({"a": 1})) == "3"
    assert asyncio.run(add.acall({"a": "4", "b": 1})) == "5"  # pydantic's lax int parsing


@pytest.mark.parametrize(
    "args, needle",
    [
        ({}, "a: Field required"),
        ({"a": "x"}, "a: Input should be a valid integer"),
        ({"a": 1, "c": 3}, "c: Extra inputs are not permitted"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_arguments_name_the_problem(args, needle):
    with pytest.raises(ToolError, match=needle):
        asyncio.run(add.acall(args))


def test_tool_exception_becomes_tool_error():
    @tool
    def boom(x: int) -> int:
        """Always fails."""
        return 1 // 0

    with pytest.raises(ToolError, match="boom raised ZeroDivisionError"):
        asyncio.run(boom.acall({"x": 1}))


def test_async_tool_and_method_binding():
    class Holder:
        base = 10

        @tool
        async def plus(self, x: int) -> dict:
            """Add the base."""
            return {"value": self.base + x}

    h = Holder()
    assert isinstance(Holder.plus, Tool)
    assert "self" not in h.plus.schema["function"]["parameters"]["properties"]
    assert asyncio.run(h.plus.acall({"x": 1})) == '{"value": 11}'


def test_definition_errors_are_loud():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="needs a description"):
        tool(undocumented)
    with pytest.raises(TypeError, match="needs a type annotation"):

        @tool
        def f(x):
            """Doc."""

    with pytest.raises(ValueError, match="tool name"):
        tool(name="bad name!")(add.fn)


@tool
def nap(seconds: float) -> str:
    """Sleep (a sync tool waiting on I/O), then say which thread ran it."""
    time.sleep(seconds)
    return threading.current_thread().name


def test_many_sync_tool_calls_run_in_one_wave():
    """64 sync calls of 0.2 s at once: asyncio's default pool (min(32, cpus + 4) threads, 6 on a
    2-core machine) ran them 6 at a time, 2.2 s; the user pool runs them all at once."""

    async def main():
        t0 = time.perf_counter()
        names = await asyncio.gather(*(nap.acall({"seconds": 0.2}) for _ in range(64)))
        return names, time.perf_counter() - t0

    names, elapsed = asyncio.run(main())
    assert all(n.startswith("agentgrpo-user") for n in names)
    assert elapsed < 0.8, elapsed  # one wave: 0.2 s plus thread start-up


def test_a_stuck_call_does_not_starve_later_ones(monkeypatch):
    """Calls that overran their deadline keep their threads (threads cannot be killed); they are
    counted, warned about once, and later calls still run at once."""
    release = threading.Event()

    @tool
    def hang() -> str:
        """Wait until released (a call that never returns in time)."""
        release.wait(5)
        return "late"

    monkeypatch.setattr(tool_module, "STUCK_WARN_AT", 4)
    monkeypatch.setattr(tool_module, "_warned", False)
    wait_until_no_stuck_calls()  # abandoned calls of earlier tests (sleeping tools) finish first

    async def main():
        for _ in range(8):  # more than asyncio's default pool has threads here
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(hang.acall({}), 0.05)
        stuck = stuck_user_calls()
        t0 = time.perf_counter()
        await asyncio.gather(*(nap.acall({"seconds": 0.1}) for _ in range(16)))
        return stuck, time.perf_counter() - t0

    try:
        with pytest.warns(
            RuntimeWarning, match=r"4 sync calls of user code \(the latest: .*hang\) overran"
        ) as w:
            stuck, elapsed = asyncio.run(main())
    finally:
        release.set()
    assert len([x for x in w if issubclass(x.category, RuntimeWarning)]) == 1  # once, not per call
    assert stuck == 8 and elapsed < 0.6, (stuck, elapsed)
    wait_until_no_stuck_calls()  # released when their code returned


def wait_until_no_stuck_calls(timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while stuck_user_calls() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stuck_user_calls() == 0


def test_to_user_thread_keeps_context_and_drops_queued_calls():
    var = contextvars.ContextVar("var", default="unset")

    async def main():
        var.set("set")
        return await to_user_thread(var.get)

    assert asyncio.run(main()) == "set"  # like asyncio.to_thread: context variables travel along

    ran = []
    wait_until_no_stuck_calls()

    def never_started():
        ran.append(1)

    async def cancelled_in_queue():
        gate = threading.Event()
        blockers = [
            asyncio.ensure_future(to_user_thread(gate.wait, 5))
            for _ in range(tool_module.USER_THREADS)
        ]
        await asyncio.sleep(0.2)  # every thread busy: the next call waits in the queue
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(to_user_thread(never_started), 0.05)
        stuck = stuck_user_calls()
        gate.set()
        await asyncio.gather(*blockers)
        return stuck

    assert asyncio.run(cancelled_in_queue()) == 0 and ran == []  # dropped, never run, never stuck


def test_a_forked_child_gets_its_own_pool():
    import multiprocessing

    asyncio.run(to_user_thread(time.sleep, 0))  # the parent's pool exists and has an idle thread
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply(_name_of_user_thread, ()).startswith(
            "agentgrpo-user"
        )  # ran, did not hang


def _name_of_user_thread() -> str:
    return asyncio.run(asyncio.wait_for(to_user_thread(lambda: threading.current_thread().name), 5))


def test_an_awaitable_returned_by_a_sync_function_is_awaited():
    """An async tool under a plain `functools.wraps` decorator looks sync: its coroutine is awaited
    (as `call_env` does for env methods), not shown to the model as '<coroutine object ...>'."""
    import functools

    def logged(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            return f(*args, **kwargs)

        return wrapper

    ran = []

    @tool
    @logged
    async def lookup(key: str) -> str:
        """Look a key up."""
        ran.append(key)
        if key == "bad":
            raise KeyError(key)
        return f"value of {key}"

    assert not lookup.is_async
    assert asyncio.run(lookup.acall({"key": "a"})) == "value of a" and ran == ["a"]
    with pytest.raises(
        ToolError, match="lookup raised KeyError"
    ):  # its failure is a tool error too
        asyncio.run(lookup.acall({"key": "bad"}))


def test_string_annotations_resolve_in_the_tools_module(tmp_path, monkeypatch):
    # Under `from __future__ import annotations` a tool's types are strings; they used to be
    # resolved in agentgrpo.env.tool's namespace, so Literal or a user's model failed at @tool.
    (tmp_path / "future_tools.py").write_text(
        "from __future__ import annotations\n"
        "from typing import Literal\n"
        "import pydantic\n"
        "from agentgrpo.env.tool import tool\n"
        "class Point(pydantic.BaseModel):\n"
        "    x: int\n"
        "@tool\n"
        "def move(p: Point, mode: Literal['fast', 'slow'] = 'fast') -> str:\n"
        "    '''Move.'''\n"
        "    return f'{p.x} {mode}'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("future_tools")
    assert mod.move.schema["function"]["parameters"]["properties"]["mode"]["enum"] == [
        "fast",
        "slow",
    ]
    assert mod.move(**mod.move.validate({"p": {"x": 3}, "mode": "slow"})) == "3 slow"
    with pytest.raises(ToolError, match="mode"):
        mod.move.validate({"p": {"x": 3}, "mode": "warp"})


def test_an_annotation_naming_nothing_is_a_clear_error():
    ns: dict = {}
    exec("def f(x: 'Undefined') -> str:\n    '''Doc.'''\n", ns)
    with pytest.raises(TypeError, match="f.*annotation names something undefined.*Undefined"):
        tool(ns["f"])


def test_a_misspelt_key_of_a_nested_model_is_refused_not_defaulted():
    import pydantic

    tool_module = importlib.import_module(
        "agentgrpo.env.tool"
    )  # `agentgrpo.env.tool` is also the decorator

    class Point(pydantic.BaseModel):
        x: int
        y: int = 0

    @tool
    def move(p: Point) -> str:
        """Move."""
        return str(p)

    if not tool_module._EXTRA_PER_CALL:
        pytest.skip("this pydantic cannot forbid nested extras per validation")
    with pytest.raises(ToolError, match=r"p\.yy: Extra inputs are not permitted"):
        move.validate({"p": {"x": 1, "yy": 5}})  # used to give Point(x=1, y=0) silently
    assert move.schema["function"]["parameters"]["$defs"]["Point"]["additionalProperties"] is False
    assert move.validate({"p": {"x": 1, "y": 2}}) == {"p": Point(x=1, y=2)}
