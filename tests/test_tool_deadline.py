"""`tool_timeout_s` charges a tool call only for the time it runs: time spent waiting for a worker
thread, a sandbox slot, or anything marked with `waiting_for_capacity` is load, not the model's
doing, and must not come back to the model as a TOOL_TIMEOUT."""

import asyncio
import importlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agentgrpo import Message, Task, ToolCall, ToolEnv, tool
from agentgrpo.deadlines import WaitClock, run_charging_only_running_time, waiting_for_capacity
from agentgrpo.verify.sandbox import Limits, Sandbox, SandboxConfig
from tools.python import PythonToolConfig, make_async_python_tool, make_python_tool

tool_mod = importlib.import_module(
    "agentgrpo.env.tool"
)  # `agentgrpo.env.tool` is also the decorator

TASK = Task(id="t", prompt="p", answer=1)


class Queued(ToolEnv):
    tool_timeout_s = 0.3

    @tool
    def fetch(self, wait_s: float, work_s: float) -> str:
        """Wait for a shared resource, then work."""
        with waiting_for_capacity():
            time.sleep(wait_s)
        time.sleep(work_s)
        return "fetched"

    def reward(self, task, messages):
        return 1.0


def _step(env: ToolEnv, *calls: ToolCall):
    env.reset(options={"task": TASK})
    return asyncio.run(env.step(Message(role="assistant", content="", tool_calls=list(calls))))


def _out_and_step(env, call):
    step = _step(env, call)
    return step.messages, step


def _kinds(step) -> dict[str, int]:
    """The step's tool errors by kind, as trajectories.jsonl writes them."""
    return {kind.value: n for kind, n in step.tool_errors.items()}


def test_time_waiting_for_capacity_is_not_charged_to_the_tool_deadline():
    out, step = _out_and_step(
        Queued(), ToolCall(id="1", name="fetch", arguments={"wait_s": 0.6, "work_s": 0.05})
    )
    assert out[0].content == "fetched" and not step.tool_errors


def test_running_time_after_a_wait_is_still_bounded():
    t0 = time.monotonic()
    out, step = _out_and_step(
        Queued(), ToolCall(id="1", name="fetch", arguments={"wait_s": 0.3, "work_s": 1.0})
    )
    took = time.monotonic() - t0
    assert _kinds(step) == {"tool_timeout": 1}
    assert "did not finish within 0.3 s" in out[0].content
    assert 0.55 < took < 1.0  # the 0.3 s wait plus the 0.3 s of running time, not the whole second


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_queue_time_for_a_sandbox_slot_is_not_a_tool_timeout():
    box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1))
    try:

        class PyEnv(ToolEnv):
            tool_timeout_s = 0.6
            tools = (tool(make_python_tool(box)),)

            def reward(self, task, messages):
                return 1.0

        blocker = threading.Thread(
            target=box.run,
            args=("import time; time.sleep(1.5)",),
            kwargs={"limits": Limits(wall_s=5)},
        )
        blocker.start()
        time.sleep(0.2)  # the one slot is busy now; the tool's job queues behind it for about 1.3 s
        out, step = _out_and_step(
            PyEnv(), ToolCall(id="1", name="python", arguments={"code": "print(2+2)"})
        )
        blocker.join()
        assert not step.tool_errors, out[0].content
        assert "status: ok" in out[0].content and "4" in out[0].content
    finally:
        box.close()


def test_time_queued_for_a_worker_thread_is_a_wait(monkeypatch):
    pool = ThreadPoolExecutor(1)
    monkeypatch.setattr(tool_mod, "_user_executor", lambda: pool)
    release = threading.Event()
    pool.submit(release.wait, 5)  # the only thread is busy

    async def main():
        async def call():
            return await tool_mod.to_user_thread(lambda: "ran")

        timer = asyncio.get_running_loop().call_later(0.4, release.set)
        try:
            return await run_charging_only_running_time(call(), 0.2)
        finally:
            timer.cancel()

    result, waited = asyncio.run(main())
    pool.shutdown()
    assert result == "ran" and waited >= 0.35


def test_wait_clock_counts_overlapping_waits_once_and_stops_are_idempotent():
    clock = WaitClock()
    a = clock.start()
    time.sleep(0.1)
    b = clock.start()
    time.sleep(0.1)
    a()
    a()  # a second stop of the same wait does not close the other one
    assert clock.waiting
    time.sleep(0.1)
    b()
    assert not clock.waiting and 0.28 < clock.waited_s() < 0.6


def test_a_cancelled_caller_cancels_the_call():
    started, cancelled = asyncio.Event(), []

    async def main():
        async def slow():
            started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        outer = asyncio.ensure_future(run_charging_only_running_time(slow(), 5))
        await started.wait()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0)

    asyncio.run(main())
    assert cancelled == [True]


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_a_sandbox_job_whose_caller_gave_up_does_not_stop_the_sandbox():
    """An async tool timed out mid-job cancels the job's future; its result, arriving later, used to
    kill the sandbox's reader thread, after which no result was read and every later call waited
    for a slot forever (its wait open, so it never even timed out)."""
    box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1))

    class AsyncPy(ToolEnv):
        tool_timeout_s = 0.5

        @tool
        async def python(self, code: str) -> str:
            """Run code."""
            return (await box.arun(code, limits=Limits(wall_s=3))).stdout

        def reward(self, task, messages):
            return 1.0

    async def call(code: str):
        env = AsyncPy()
        env.reset(options={"task": TASK})
        msg = Message(
            role="assistant",
            content="",
            tool_calls=[ToolCall(id="1", name="python", arguments={"code": code})],
        )
        step = await asyncio.wait_for(env.step(msg), 8)
        return step.messages[0].content, _kinds(step)

    async def main():
        slow = await call("import time; time.sleep(1)")
        await asyncio.sleep(1.0)  # its job finishes in the sandbox; nobody awaits it any more
        return slow, await call("print(4)"), await call("print(5)")

    try:
        slow, second, third = asyncio.run(main())
        assert slow[1] == {"tool_timeout": 1}
        assert second == ("4\n", {}) and third == ("5\n", {})
    finally:
        box.close()


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_a_job_cancelled_while_queued_is_never_run_and_close_answers_the_queue():
    box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1))
    client = box._impl
    try:
        busy = client.submit(b"import time; time.sleep(0.6)", b"", [], Limits(wall_s=3))
        given_up = client.submit(b"print('never')", b"", [], Limits(wall_s=3))
        assert given_up.cancel()  # still queued: cancellable
        after = client.submit(b"print('after')", b"", [], Limits(wall_s=3))
        assert busy.result(5).status == "ok" and after.result(5).stdout == "after\n"
        busy = client.submit(b"import time; time.sleep(2)", b"", [], Limits(wall_s=5))
        queued = client.submit(b"print(1)", b"", [], Limits(wall_s=5))
        time.sleep(0.2)
    finally:
        box.close()
    assert queued.result(2).status == "sandbox_error" and "closed" in queued.result().detail


def test_no_tool_deadline_means_none():
    async def main():
        return await run_charging_only_running_time(asyncio.sleep(0.05, "done"), None)

    assert asyncio.run(main())[0] == "done"


def test_an_open_wait_late_in_a_call_is_not_polled_in_a_busy_loop(monkeypatch):
    import agentgrpo.deadlines as deadlines

    polls = []
    real_waited = deadlines.WaitClock.waited_s

    def counting(self):
        polls.append(1)
        return real_waited(self)

    monkeypatch.setattr(deadlines.WaitClock, "waited_s", counting)

    async def almost_out_then_wait():
        time.sleep(0.19)  # nearly all of the 0.2 s budget runs (blocking the loop, so no poll)
        with waiting_for_capacity():
            await asyncio.sleep(0.5)
        return "ok"

    async def main():
        return await run_charging_only_running_time(almost_out_then_wait(), 0.2)

    assert asyncio.run(main())[0] == "ok"
    assert len(polls) < 40  # one look per 50 ms of the wait, not one per millisecond


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
@pytest.mark.parametrize("backend", ["unsafe-local", "namespaces"])
def test_an_async_python_call_past_its_deadline_frees_its_sandbox_slot_at_once(backend):
    """The async python tool's call, cancelled at `tool_timeout_s`, kills its job: with the sync
    tool the job ran on to its 30 s wall limit, holding the only slot, and the next call waited for
    it."""
    try:
        box = Sandbox(backend=backend, config=SandboxConfig(slots=1))
    except (RuntimeError, OSError) as e:  # namespaces needs root (CI runs as root)
        pytest.skip(f"{backend} sandbox backend cannot start on this host: {e}")
    try:

        class PyEnv(ToolEnv):
            tool_timeout_s = 0.5
            tools = (tool(make_async_python_tool(box, PythonToolConfig(limits=Limits(wall_s=30)))),)

            def reward(self, task, messages):
                return 1.0

        out, step = _out_and_step(
            PyEnv(),
            ToolCall(id="1", name="python", arguments={"code": "import time; time.sleep(30)"}),
        )
        assert _kinds(step) == {"tool_timeout": 1}, out[0].content
        t0 = time.monotonic()
        res = box.run("print('next')", limits=Limits(wall_s=5))
        assert (res.status, res.stdout) == ("ok", "next\n")
        assert time.monotonic() - t0 < 10  # the slot was free within moments, not after 30 s
    finally:
        box.close()


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_a_job_cancelled_before_the_supervisor_starts_it_is_killed_when_it_does():
    box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1))
    client = box._impl
    try:
        assert client.submit(b"print('a')", b"", [], Limits(wall_s=5)).result(5).status == "ok"
        # Sent at once (the client counts the slot free), while the supervisor still re-readies it
        # (a fresh interpreter): the cancel right behind it finds it waiting, not running.
        given_up = client.submit(b"import time; time.sleep(30)", b"", [], Limits(wall_s=30))
        client.abandon(given_up)
        res = given_up.result(10)
        assert (res.status, res.detail) == ("sandbox_error", "cancelled: its caller gave up")
        assert client.submit(b"print('b')", b"", [], Limits(wall_s=5)).result(5).stdout == "b\n"
    finally:
        box.close()


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_a_cancel_sent_as_its_job_is_dispatched_goes_after_the_job(monkeypatch):
    """`abandon` on a job the client has just counted in flight but not yet sent: a cancel that
    overtook the job frame was ignored by the supervisor, and the job then held its slot to its
    wall limit. The hook runs at that moment (the job's queue wait ends) and abandons from a
    second thread, as an event loop cancelling `arun` would."""
    from agentgrpo.verify import _local_client

    made = []

    class Recorded(_local_client.Future):
        def __init__(self):
            super().__init__()
            made.append(self)

    box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1))
    client = box._impl
    giver = []

    def stop_wait():  # the job's queue wait ends: it is about to be sent
        if not giver:
            giver.append(threading.Thread(target=client.abandon, args=(made[-1],)))
            giver[0].start()
            time.sleep(0.3)  # the abandon reaches its send while this job's frame is not out yet

    try:
        monkeypatch.setattr(_local_client, "Future", Recorded)
        monkeypatch.setattr(_local_client, "start_wait", lambda: stop_wait)
        given_up = client.submit(b"import time; time.sleep(60)", b"", [], Limits(wall_s=60))
        giver[0].join(10)
        res = given_up.result(20)  # not after 60 s
        assert (res.status, res.detail) == ("sandbox_error", "cancelled: its caller gave up")
        assert client.submit(b"print('b')", b"", [], Limits(wall_s=5)).result(10).stdout == "b\n"
    finally:
        box.close()


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_an_async_call_never_starts_a_supervisor_on_the_event_loop(monkeypatch):
    """The first call of the async tool creates the default sandbox (probing backends and starting
    one: up to `start_timeout_s` each), and a call after the supervisor died restarts it: both
    happen off the event loop's thread, which keeps running the other episodes meanwhile."""
    import agentgrpo.verify.sandbox as sandbox_mod
    from agentgrpo.verify import _local_client

    started_on = []
    real_popen = _local_client.subprocess.Popen

    def popen(args, **kw):
        if "_supervisor" in " ".join(map(str, args)):
            started_on.append(threading.current_thread())
        return real_popen(args, **kw)

    monkeypatch.setattr(_local_client.subprocess, "Popen", popen)
    monkeypatch.setattr(sandbox_mod, "_DEFAULT", None)
    monkeypatch.setattr(sandbox_mod, "Sandbox", lambda: Sandbox(backend="unsafe-local"))
    tool = make_async_python_tool(None, PythonToolConfig(limits=Limits(wall_s=5)))

    async def main():
        loop_thread = threading.current_thread()
        first = await tool("print(1)")
        box = sandbox_mod._DEFAULT
        box._impl._proc.kill()  # infrastructure failure: the next call restarts the supervisor
        while box._impl._sock is not None:
            await asyncio.sleep(0.01)
        second = await tool("print(2)")
        return loop_thread, first, second

    try:
        loop_thread, first, second = asyncio.run(main())
        assert "1\n" in first and "2\n" in second
        assert len(started_on) == 2 and loop_thread not in started_on
    finally:
        sandbox_mod._DEFAULT.close()


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_a_blocking_run_whose_caller_gives_up_kills_its_job():
    box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1, retries=2))
    try:
        t0 = time.monotonic()
        res = box.run(
            "import time; time.sleep(30)",
            limits=Limits(wall_s=30),
            gave_up=lambda: time.monotonic() - t0 > 0.5,
        )
        assert (res.status, res.detail) == ("sandbox_error", "cancelled: its caller gave up")
        queued_at = time.monotonic()
        busy = box._impl.submit(b"import time; time.sleep(30)", b"", [], Limits(wall_s=30))
        res = box.run(
            "print('never')",
            limits=Limits(wall_s=5),  # queued behind `busy`
            gave_up=lambda: time.monotonic() - queued_at > 0.5,
        )
        assert res.detail == "cancelled: its caller gave up"
        box._impl.abandon(busy)
        # the one slot is free within moments (each given-up job was killed), not after 30 s
        assert box._impl.submit(b"print('b')", b"", [], Limits(wall_s=5)).result(10).stdout == "b\n"
    finally:
        box.close()


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_a_restart_that_fails_unexpectedly_answers_its_queue_and_is_tried_again(monkeypatch):
    box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1, retries=0))
    client = box._impl
    real, tries = client._connect, []

    def flaky():
        tries.append(1)
        if len(tries) == 1:
            raise KeyError("features")  # not a RuntimeError: a hello frame without a field, say
        return real()

    try:
        monkeypatch.setattr(client, "_connect", flaky)
        client._proc.kill()
        while client._sock is not None:
            time.sleep(0.01)
        first = client.submit(b"print(1)", b"", [], Limits(wall_s=5)).result(10)
        assert first.status == "sandbox_error" and "KeyError" in first.detail
        assert client.submit(b"print(2)", b"", [], Limits(wall_s=5)).result(10).stdout == "2\n"
    finally:
        box.close()


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_close_waits_for_a_supervisor_another_thread_is_still_killing():
    import os
    import signal

    box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1))
    client = box._impl
    pid = client._proc.pid
    os.kill(pid, signal.SIGSTOP)  # hung: it will not exit on EOF, so its kill takes a while
    dropper = threading.Thread(
        target=client._drop, args=(client._sock, "supervisor missed a job deadline")
    )
    dropper.start()
    time.sleep(0.1)  # the drop is killing it, outside `_lock`
    box.close()
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().split()[2]
    except FileNotFoundError:
        state = "gone"
    dropper.join(10)
    assert state in ("gone", "Z")  # not left behind when close() returned


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_the_default_sandboxs_first_start_is_not_charged_to_the_tool(monkeypatch):
    import agentgrpo.verify.sandbox as sandbox_mod

    def slow_start():
        time.sleep(2.0)  # probing: a backend that fails after a while, before one that works
        return Sandbox(backend="unsafe-local")

    monkeypatch.setattr(sandbox_mod, "_DEFAULT", None)
    monkeypatch.setattr(sandbox_mod, "Sandbox", slow_start)
    tool = make_async_python_tool(None, PythonToolConfig(limits=Limits(wall_s=5)))

    async def main():
        return await asyncio.gather(
            *(run_charging_only_running_time(tool(f"print({i})"), 1.0) for i in range(4))
        )

    try:
        outs = asyncio.run(main())
        assert [out.split("stdout:\n")[1].strip() for out, _ in outs] == ["0", "1", "2", "3"]
        assert all(waited >= 1.5 for _, waited in outs)
    finally:
        sandbox_mod._DEFAULT.close()


@pytest.mark.filterwarnings("ignore:Sandbox.backend=.unsafe-local")
def test_a_big_frame_waits_for_a_supervisor_busy_for_a_moment():
    """The client's socket times out after 0.25 s (its reader polls deadlines), and sendall used
    that as its bound: a frame bigger than the socket buffer, sent while the supervisor did not read
    for a moment, dropped the supervisor and failed every job in flight."""
    import os
    import signal

    box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1, retries=0))
    pid = box._impl._proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)  # busy for a second
        timer = threading.Timer(1.0, os.kill, (pid, signal.SIGCONT))
        timer.start()
        res = box.run(
            "import os; print(os.path.getsize('big'))",
            files={"big": b"x" * (8 << 20)},
            limits=Limits(wall_s=10),
        )
        timer.join()
        assert (res.status, res.stdout) == ("ok", f"{8 << 20}\n"), res.detail
        assert box._impl._proc.pid == pid  # the same supervisor: not dropped and restarted
    finally:
        box.close()
