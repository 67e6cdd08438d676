"""Supervisor process of the local sandbox backends: slots, deadlines, output caps, kill-all.

One supervisor serves one `Sandbox` client over a socketpair, in a process of its own so that the
trainer's GIL and memory never sit on a job's path. It owns the slots (each with its own uid,
network namespace and cgroups), the pre-started job of each free slot, the wall deadline (a pidfd
kill of the job's init and `cgroup.kill`), the output caps, cancels, and the classification of a
job's end. One running job is `_job.py`; launchers (`namespaces`: the fork server; `bwrap`,
`unsafe-local`: a fresh interpreter per job) are `_launchers.py`. docs/sandbox.md ("Inside the
local backends") has the details.

Stdlib only; started as `python -I -c ... VERIFY_DIR CONFIG_JSON SOCKET_FD`.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable

try:
    from . import _runner
    from ._cgroups import Cgroups
    from ._frames import pack, unpack
    from ._job import _classify, _Job
    from ._launchers import ForkServerLauncher, LaunchError, SubprocessLauncher
except ImportError:  # started as a plain script: siblings are top-level modules
    import _runner
    from _cgroups import Cgroups
    from _frames import pack, unpack
    from _job import _classify, _Job
    from _launchers import ForkServerLauncher, LaunchError, SubprocessLauncher

CLEAN_ENV = _runner.CLEAN_ENV
__all__ = ["CLEAN_ENV", "Supervisor", "main", "pack", "unpack"]  # pack, unpack: `_frames.py`


async def _readable(fd: int, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(True))
    try:
        return await asyncio.wait_for(fut, timeout)
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


UID_BLOCKS = 65536  # uid_base .. uid_base + 256 * UID_BLOCKS are reserved for sandboxes
WARM_MAX_AGE_S = (
    1800.0  # a pre-started job older than this is replaced (its init's backstop is 1 h)
)


def _warm_key(lim: dict) -> tuple:
    """Limits a pre-started job has already applied (output_bytes is enforced here, not there)."""
    return (
        lim["memory_mb"],
        lim["processes"],
        lim["disk_mb"],
        lim["open_files"],
        int(lim["wall_s"]),
    )


class _Warm:
    """A job started up to the point where it waits for its payload."""

    def __init__(self, key: tuple, handle: dict, ours: list[int], born: float) -> None:
        self.key, self.handle, self.ours, self.born = key, handle, ours, born

    def dead(self) -> bool:
        return bool(select.select([self.handle["pidfd"]], [], [], 0)[0])

    def close(self) -> None:
        for i, fd in enumerate(self.ours):
            if fd >= 0:
                os.close(fd)
                self.ours[i] = -1
        if self.handle.get("pidfd", -1) >= 0:
            os.close(self.handle["pidfd"])
            self.handle["pidfd"] = -1


class Supervisor:
    def __init__(self, cfg: dict, verify_dir: str) -> None:
        # Each supervisor gets its own block of 256 uids (its init, then one per slot), so jobs of
        # two sandboxes on one host never share a uid (RLIMIT_NPROC and signals are per uid).
        block = cfg["uid_base"] + (os.getpid() % UID_BLOCKS) * 256
        cfg = dict(cfg, init_uid=block, job_uid_base=block + 1)
        self.cfg = cfg
        self.slots = cfg["slots"]
        self.cg = Cgroups(self.slots, enabled=cfg["backend"] != "unsafe-local")
        if cfg["backend"] == "namespaces":
            self.launcher = ForkServerLauncher(cfg, self.cg, verify_dir)
        else:
            self.launcher = SubprocessLauncher(cfg["backend"], cfg, self.cg)
        self._free: list[int] = []
        self._cv: asyncio.Condition | None = None
        self._warm: dict[int, asyncio.Future] = {}  # slot -> pre-start in progress or done
        self._warm_keys: dict[int, tuple] = {}
        self._cleanups: set[asyncio.Task] = set()
        self._closing = False
        self.running: dict[int, tuple[_Job, dict]] = {}
        self._kills: dict[int, Callable[[str], None]] = {}  # job id -> kill, while it runs
        self._waiting: set[int] = set()  # received, not running yet
        self._cancelled: set[int] = set()  # of those, cancelled

    async def start(self) -> dict:
        self._cv = asyncio.Condition()
        await self.launcher.start()
        for slot in range(self.slots):  # pre-start every slot with the default limits
            self._warm[slot] = asyncio.ensure_future(
                self._prepare(slot, self.cfg["default_limits"])
            )
            self._warm[slot].add_done_callback(lambda t: t.cancelled() or t.exception())
            self._free.append(slot)
        return {
            "backend": self.launcher.name,
            "slots": self.slots,
            "features": self.launcher.features,
        }

    def cancel(self, jid: int) -> None:
        """Kill job `jid` now if it runs, or as soon as it starts if it still waits for a slot. Its
        answer is still sent (the client frees its slot on it); an id already answered is
        ignored."""
        if jid in self._kills:
            self._kills[jid]("cancelled")
        elif jid in self._waiting:
            self._cancelled.add(jid)

    def received(self, jid: int) -> None:
        """Job `jid` has arrived (called as its frame is read, so a cancel right behind it finds
        it)."""
        self._waiting.add(jid)

    async def run(self, req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
        try:
            return await self._run_when_free(req, blobs)
        finally:
            self._waiting.discard(req["id"])
            self._cancelled.discard(req["id"])

    async def _run_when_free(self, req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
        lim = req["limits"]
        key = _warm_key(lim)
        slot = await self._acquire(key)
        t0 = time.monotonic()
        warm: _Warm | None = None
        try:
            warm = await self._take_warm(slot, key, lim)
            res, out, err = await self._run(slot, warm, req, blobs)
        except (OSError, LaunchError) as e:  # infrastructure failure: retried by the client
            res, out, err = (
                {
                    "status": "sandbox_error",
                    "detail": f"{type(e).__name__}: {e}",
                    "exit_code": None,
                    "signal": None,
                },
                b"",
                b"",
            )
        finally:
            # the reply goes out now; the slot is re-warmed once it is verifiably empty
            t = asyncio.ensure_future(self._recycle(slot, lim, warm))
            self._cleanups.add(t)
            t.add_done_callback(self._cleanups.discard)
        res.update(id=req["id"], wall_s=time.monotonic() - t0, backend=self.launcher.name)
        return res, [out, err]

    async def _acquire(self, key: tuple) -> int:
        async with self._cv:
            await self._cv.wait_for(lambda: bool(self._free))
            slot = next((s for s in self._free if self._warm_keys.get(s) == key), self._free[0])
            self._free.remove(slot)
            return slot

    async def _take_warm(self, slot: int, key: tuple, lim: dict) -> _Warm:
        """The slot's pre-started job if it matches these limits and is alive, else a fresh one."""
        task = self._warm.pop(slot, None)
        warm = None
        if task is not None:
            try:
                warm = await task
            except (OSError, LaunchError):  # the pre-start failed: start afresh below
                warm = None
            if warm is not None and (
                warm.key != key or warm.dead() or time.monotonic() - warm.born > WARM_MAX_AGE_S
            ):
                self._discard(slot, warm)
                await self._wait_empty(slot)
                warm = None
        return warm if warm is not None else await self._prepare(slot, lim)

    async def _prepare(self, slot: int, lim: dict) -> _Warm:
        """Start a job up to the point where it waits for its payload (namespaces, limits, uid)."""
        pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(5)]  # stdin, stdout, stderr, payload, status
        child = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][0], pipes[4][1]]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][1], pipes[4][0]]
        self.cg.prepare(slot, lim)
        self._warm_keys[slot] = _warm_key(lim)
        try:
            handle = await self.launcher.launch(slot, lim, child)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in child:
                os.close(fd)
        for fd in ours:
            os.set_blocking(fd, False)
        return _Warm(_warm_key(lim), handle, ours, time.monotonic())

    def _discard(self, slot: int, warm: _Warm) -> None:
        self.launcher.kill(warm.handle, slot)
        self.launcher.reap(warm.handle)
        warm.close()

    async def _wait_empty(self, slot: int) -> bool:
        if not self.cg.procs_paths(slot):
            return True
        for i in range(500):
            if self.cg.empty(slot):
                return True
            if i % 50 == 0:
                self.cg.kill(slot)
            await asyncio.sleep(0.001 if i < 20 else 0.01)
        return False

    async def _recycle(self, slot: int, lim: dict, used: _Warm | None) -> None:
        if used is not None:  # its init may still be exiting: wait, kill if it lingers, reap
            if not await _readable(used.handle["pidfd"], 1.0):
                self.launcher.kill(used.handle, slot)
                await _readable(used.handle["pidfd"], 5.0)
            self.launcher.reap(used.handle)
            used.close()
        if not await self._wait_empty(slot):  # a process we cannot kill: keep the slot out of use
            print(f"agentgrpo sandbox: slot {slot} could not be emptied; retired", file=sys.stderr)
            return
        if not self._closing:
            self._warm[slot] = asyncio.ensure_future(self._prepare(slot, lim))
            self._warm[slot].add_done_callback(lambda t: t.cancelled() or t.exception())
        async with self._cv:
            self._free.append(slot)
            self._cv.notify()

    async def _run(self, slot: int, warm: _Warm, req: dict, blobs: list[bytes]):
        loop = asyncio.get_running_loop()
        lim = req["limits"]
        code, stdin, files = blobs[0], blobs[1], list(zip(req["files"], blobs[2:], strict=True))
        job = _Job(loop, lim)
        handle, ours = warm.handle, warm.ours
        header = {
            "limits": lim,
            "code_len": len(code),
            "files": [[n, len(b)] for n, b in files],
            "workdir": handle.get("workdir"),
        }
        h = json.dumps(header).encode()
        payload = b"".join([struct.pack("!I", len(h)), h, code] + [b for _, b in files])
        self.running[slot] = (job, handle)

        def kill(reason: str) -> None:
            if job.killed_for is None:
                job.killed_for = reason
            self.launcher.kill(handle, slot)

        self._kills[req["id"]] = kill

        try:
            # the pipes now belong to the job (it closes them); the warm record keeps the pidfd
            stdin_w, out_r, err_r, payload_w, status_r = ours
            warm.ours = []
            timer = loop.call_later(lim["wall_s"], kill, "timeout")
            job.write_all(payload_w, payload)
            job.write_all(stdin_w, stdin)
            job.read_stream(out_r, job.out, lambda: kill("output"))
            job.read_stream(err_r, job.err, lambda: kill("output"))
            job.read_status(status_r)
            job.watch_init(handle["pidfd"])
            if req["id"] in self._cancelled:  # while it waited for its slot
                kill("cancelled")
            try:
                await job.done
            finally:
                timer.cancel()
            if job.open_streams:
                # The job ended but something still holds its output open: leftovers (killed by
                # the kernel with its init in the namespaces backend; killed here otherwise).
                self.launcher.kill(handle, slot)
                try:
                    await asyncio.wait_for(asyncio.shield(job.streams_closed), 2.0)
                except asyncio.TimeoutError:
                    kill(job.killed_for or "timeout")
                    job.status.append({"error": "output pipes held open after the job ended"})
            job.drain_status()
            status = job.status
            if handle.get("pid") is not None and not job.final:  # runner vanished (subprocess)
                try:
                    _, wstatus = os.waitpid(handle["pid"], 0)
                    handle["pid"] = None
                    status.append(self._runner_vanished(wstatus, job))
                except ChildProcessError:
                    pass
            oom = self.cg.oom_killed(slot)
            res = _classify(job, status, oom)
            return res, bytes(job.out), bytes(job.err)
        finally:
            self.running.pop(slot, None)
            self._kills.pop(req["id"], None)
            job.close()

    def _runner_vanished(self, wstatus: int, job: _Job) -> dict:
        """A fresh-interpreter job ended without its runner's report (bwrap / unsafe-local).

        bwrap failing to set up exits 1 and says "bwrap: ..." on stderr: an infrastructure error.
        Otherwise the job took its own runner down (they share a uid there), which is the job's
        failure and must not turn into an unscorable sample: report what bwrap passed on
        (128+N means the runner died of signal N).
        """
        code = os.waitstatus_to_exitcode(wstatus)
        if self.launcher.name == "bwrap" and code == 1 and job.err.startswith(b"bwrap:"):
            return {"error": bytes(job.err[:500]).decode(errors="replace").strip()}
        if code > 128:
            return {"wstatus": (code - 128) & 0x7F}  # as if killed by that signal
        return {"wstatus": wstatus}

    def close(self) -> None:
        self._closing = True
        for slot, (_job, handle) in list(self.running.items()):
            self.launcher.kill(handle, slot)
        for slot, task in self._warm.items():
            if task.done() and not task.cancelled() and task.exception() is None:
                self._discard(slot, task.result())
        self.launcher.close()
        self.cg.close()


async def _serve(sup: Supervisor, sock: socket.socket) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    # SIGTERM (the client closing us) ends the read loop below; cleanup runs in main()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, writer.transport.abort)
    try:
        hello = await sup.start()
    except (OSError, LaunchError, subprocess.SubprocessError) as e:
        writer.write(pack({"op": "hello", "ok": False, "error": f"{type(e).__name__}: {e}"}, []))
        await writer.drain()
        return
    writer.write(pack(dict(hello, op="hello", ok=True), []))
    await writer.drain()
    tasks: set[asyncio.Task] = set()

    async def one(header: dict, blobs: list[bytes]) -> None:
        try:
            res, out = await sup.run(header, blobs)
        except Exception as e:  # a bug here must not leave the job unanswered (the client would
            # restart the supervisor, failing every job in flight): this job alone is a sandbox
            # error
            res, out = (
                {
                    "id": header["id"],
                    "status": "sandbox_error",
                    "exit_code": None,
                    "signal": None,
                    "detail": f"supervisor: {type(e).__name__}: {e}",
                },
                [b"", b""],
            )
        if not writer.transport.is_closing():
            writer.write(pack(res, out))

    while True:
        try:
            (n,) = struct.unpack("!I", await reader.readexactly(4))
            body = await reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError):
            break  # the client went away: stop everything
        header, blobs = unpack(body)
        if header.get("op") == "cancel":
            sup.cancel(header["id"])
            continue
        sup.received(header["id"])
        t = asyncio.ensure_future(one(header, blobs))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    # No new warm jobs from here: a recycle finishing while asyncio.run cancels the rest would start
    # one that nobody awaits ("Task was destroyed but it is pending" at exit).
    sup._closing = True
    for t in list(tasks):
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str]) -> int:
    verify_dir, cfg, fd = argv[0], json.loads(argv[1]), int(argv[2])
    sock = socket.socket(fileno=fd)
    sup = Supervisor(cfg, verify_dir)
    try:
        asyncio.run(_serve(sup, sock))
    finally:
        sup.close()
    return 0
