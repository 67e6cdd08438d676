"""Sandbox sessions and task workspaces (agentgrpo/verify/session.py, workspace.py).

An episode's session keeps its files, variables and processes from call to call; another episode
and a closed one never see them; nothing of a closed one is alive; every fork of a prepared
workspace starts from the same bytes. They need the namespaces backend (root): without it the
tests skip, saying why.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from agentgrpo.env.tool import ToolError
from agentgrpo.types import InfrastructureError
from agentgrpo.verify._tree import tree_checksum
from agentgrpo.verify.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from agentgrpo.verify.session import SessionBudgetExceeded, SessionFileError, SessionLimits
from agentgrpo.verify.workspace import Workspace, WorkspaceSetupError

FORKS = ("overlay", "hardlink", "copy")
SPEC = Workspace(
    files={
        "README": "a task\n",
        "pkg/__init__.py": "",
        "pkg/mod.py": "X = 1\n",
        "run.sh": "echo hi\n",
    },
    executable=("run.sh",),
    setup=("echo built > built.txt",),
)


def _sandbox(fork: str) -> Sandbox:
    """A namespaces sandbox forking by `fork`; "bwrap": a bubblewrap one (it forks by copying)."""
    backend = "bwrap" if fork == "bwrap" else "namespaces"
    if backend == "namespaces" and os.geteuid() != 0:
        pytest.skip("the namespaces backend needs root")
    if backend == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/system-deps.sh installs it)")
    try:
        return Sandbox(
            backend=backend,
            config=SandboxConfig(slots=1, fork="copy" if backend == "bwrap" else fork),
        )
    except RuntimeError as e:
        pytest.skip(f"the {backend} backend cannot start here: {e}")


@pytest.fixture(scope="module", params=[*FORKS, "bwrap"])
def sandbox(request):
    sb = _sandbox(request.param)
    yield sb
    sb.close()


@pytest.fixture(scope="module")
def overlay():
    sb = _sandbox("overlay")
    yield sb
    sb.close()


def _alive(pid: int) -> bool:
    """True while `pid` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_a_file_written_in_call_1_is_there_in_call_5(sandbox):
    ws = await sandbox.session(SPEC)
    try:
        assert (await ws.run("echo 'from call 1' > notes.txt")).ok
        assert (await ws.run("export GREETING=hello; cd pkg")).ok
        assert (await ws.python("import pkg.mod\ncount = pkg.mod.X + 1")).ok
        assert (await ws.run('greet() { echo "$GREETING from $(pwd)"; }')).ok
        res = await ws.run("cat ../notes.txt; greet")  # call 5: the file, variable, cwd, function
        assert res.stdout == "from call 1\nhello from /workspace/pkg\n"
        assert (await ws.python("count")).stdout == "2\n"  # the REPL kept its names
        assert await ws.read("notes.txt") == "from call 1\n"
    finally:
        await ws.close()


async def test_another_episode_and_a_closed_one_never_see_it(sandbox):
    first, second = await sandbox.session(SPEC), await sandbox.session(SPEC)
    try:
        await first.write("secret.txt", "mine\n")
        await first.run("rm pkg/mod.py; echo changed > README")
        res = await second.run("ls; cat README")
        assert "secret.txt" not in res.stdout and res.stdout.endswith("a task\n")
        assert "mod.py" in (await second.run("ls pkg")).stdout  # deleted in the other one only
    finally:
        await first.close()
        await second.close()
    with pytest.raises(InfrastructureError, match="closed"):
        await first.run("ls")
    third = await sandbox.session(SPEC)  # after the close: a fresh fork, as prepared
    try:
        assert "secret.txt" not in (await third.run("ls")).stdout
        assert await third.checksum() == third.workspace_checksum
    finally:
        await third.close()


async def test_no_process_of_a_closed_episode_is_alive(sandbox):
    ws = await sandbox.session(SPEC)
    await ws.run(
        "sleep 1000 & setsid sleep 1001 & (sleep 1002 &) ; nohup sleep 1003 >/dev/null 2>&1 &"
        " (trap '' TERM HUP; exec sleep 1004) & disown"
    )
    await ws.python("import subprocess; p = subprocess.Popen(['sleep', '1005'])")
    pids = ws.processes()
    assert len(pids) >= 8  # init, bash, the REPL and six sleeps, as host pids
    await ws.close()
    assert [p for p in pids if _alive(p)] == []
    assert ws.processes() == []


async def test_a_group_of_forks_starts_from_the_same_bytes(sandbox):
    prepared = sandbox.prepare(SPEC)
    group = await asyncio.gather(*(sandbox.session(SPEC) for _ in range(8)))
    try:
        assert {ws.workspace_checksum for ws in group} == {prepared.checksum}
        inside = await asyncio.gather(*(ws.checksum() for ws in group))  # computed in each jail
        assert set(inside) == {prepared.checksum}
        await group[0].run("echo x >> built.txt; rm README")  # one member's edits ...
        assert await group[0].checksum() != prepared.checksum
        assert await group[1].checksum() == prepared.checksum  # ... reach no other member
    finally:
        await asyncio.gather(*(ws.close() for ws in group))
    assert tree_checksum(prepared.path) == prepared.checksum  # nor the prepared tree


async def test_the_checksum_covers_bytes_names_and_the_executable_bit(tmp_path):
    (tmp_path / "a").write_text("1")
    (tmp_path / "d").mkdir()
    first = tree_checksum(str(tmp_path))
    (tmp_path / "a").write_text("2")
    assert tree_checksum(str(tmp_path)) != first
    (tmp_path / "a").write_text("1")
    assert tree_checksum(str(tmp_path)) == first
    os.chmod(tmp_path / "a", 0o755)
    assert tree_checksum(str(tmp_path)) != first
    os.chmod(tmp_path / "a", 0o644)
    (tmp_path / "d" / "e").write_text("")
    assert tree_checksum(str(tmp_path)) != first


async def test_a_hardlinked_fork_cannot_write_through_its_links():
    sb = _sandbox("hardlink")
    try:
        ws = await sb.session(SPEC)
        res = await ws.run("echo more >> README")
        assert res.status == "runtime_error" and "Permission denied" in res.stdout
        assert (await ws.run("chmod u+w README")).status == "runtime_error"
        await ws.write("README", "rewritten\n")  # replaced as a whole: a new file
        assert await ws.read("README") == "rewritten\n"
        prepared = sb.prepare(SPEC)
        await ws.close()
        assert tree_checksum(prepared.path) == prepared.checksum
    finally:
        sb.close()


async def test_isolation_holds_in_a_session(sandbox, monkeypatch):
    monkeypatch.setenv("AGENTGRPO_TEST_SECRET", "s3cret")
    ws = await sandbox.session(SPEC)
    try:
        res = await ws.run("id -u; env; ls /; ls /proc | grep -c '^[0-9]'")
        uid, *rest = res.stdout.splitlines()
        assert uid != "0" and "s3cret" not in res.stdout
        assert "workspace" in rest and "home" not in rest and "work" not in rest
        net = await ws.python(
            "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 22), 1)\n"
            "    print('connected')\nexcept OSError as e:\n    print('no network', e.errno)"
        )
        assert net.stdout.startswith("no network")
        assert (await ws.run("unshare -U true")).status == "runtime_error"  # seccomp
        assert (await ws.run("cat /etc/shadow")).status == "runtime_error"
        assert (await ws.run("touch /usr/x")).status == "runtime_error"  # read-only root
    finally:
        await ws.close()


async def test_call_limits_stop_the_call_and_keep_the_files(sandbox):
    limits = SessionLimits(call_timeout_s=1.0, output_bytes=1000)
    ws = await sandbox.session(SPEC, limits=limits)
    try:
        await ws.run("echo kept > kept.txt; export V=1")
        res = await ws.run("sleep 30")
        assert res.status == "timeout" and "starts a new one" in res.detail
        flood = await ws.run("yes")
        assert flood.status == "output_limit" and flood.truncated and len(flood.stdout) == 1000
        res = await ws.run("cat kept.txt; echo V=$V")
        assert res.stdout == "kept\nV=\n"  # files stay; the restarted shell's variables do not
        slow = await ws.python("import time\nwhile True: time.sleep(1)")
        assert slow.status == "timeout"
        assert (await ws.python("1 + 1")).stdout == "2\n"  # a new REPL
    finally:
        await ws.close()


async def test_session_resources_are_bounded(overlay):
    limits = SessionLimits(memory_mb=128, processes=32, disk_mb=16, call_timeout_s=20)
    ws = await overlay.session(SPEC, limits=limits)
    try:
        mem = await ws.exec(["python3", "-c", "x = bytearray(400 << 20); print('allocated')"])
        assert mem.status != "ok" and "allocated" not in mem.stdout
        disk = await ws.run("for i in 1 2 3; do head -c 8000000 /dev/zero > big$i; done")
        assert "No space left" in disk.stdout  # 24 MB of writes; 16 MB allowed
        big = await ws.run("head -c 20000000 /dev/zero > /tmp/one")
        assert "File size limit exceeded" in big.stdout  # one file past disk_mb: RLIMIT_FSIZE
        forks = await ws.run("for i in $(seq 100); do sleep 5 & done 2>&1 | tail -1; jobs | wc -l")
        assert int(forks.stdout.split()[-1]) < 40
        assert (await ws.run("rm -f big*; kill $(jobs -p) 2>/dev/null; echo ok")).ok
    finally:
        await ws.close()


async def test_episode_budget_is_a_tool_error(overlay):
    ws = await overlay.session(None, limits=SessionLimits(max_calls=2))
    try:
        await ws.run("true")
        await ws.run("true")
        with pytest.raises(SessionBudgetExceeded, match="budget is spent") as err:
            await ws.run("true")
        assert isinstance(err.value, ToolError)  # a @tool shows it to the model
    finally:
        await ws.close()


async def test_a_cancelled_call_is_stopped_in_the_session(overlay):
    ws = await overlay.session(None)
    try:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ws.run("sleep 30"), 0.5)
        res = await asyncio.wait_for(ws.run("echo next"), 5.0)  # not queued behind the sleep
        assert res.stdout == "next\n"
    finally:
        await ws.close()


async def test_files_in_and_out(overlay):
    ws = await overlay.session(None)
    try:
        await ws.write("a/b/c.bin", b"\x00\xffdata")
        assert await ws.read_bytes("a/b/c.bin") == b"\x00\xffdata"
        with pytest.raises(SessionFileError, match="No such file"):
            await ws.read("missing.txt")
        with pytest.raises(SessionFileError, match="longer than"):
            await ws.read("a/b/c.bin", max_bytes=2)
        res = await ws.exec(
            ["python3", "-c", "import sys; print(sys.stdin.read().upper())"], stdin="x"
        )
        assert (res.stdout, res.stderr) == ("X\n", "")
    finally:
        await ws.close()


async def test_a_failing_setup_command_is_the_task_s_error(overlay):
    broken = Workspace(files={"a": "1"}, setup=("exit 7",))
    with pytest.raises(WorkspaceSetupError, match="exit 7"):
        await overlay.session(broken)


def test_sessions_need_a_local_jail():
    with pytest.warns(UserWarning, match="WITHOUT isolation"):
        sb = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1))
    try:
        with pytest.raises(SandboxUnavailable, match="namespaces \\(root\\) or bwrap"):
            sb.session_sync(None)
    finally:
        sb.close()
