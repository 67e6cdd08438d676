"""Math answer checking with `math-verify`, safe from any thread or asyncio task, never hanging.

    math_equal("so the answer is \\boxed{\\frac{1}{2}}", "0.5")   # True
    math_equal("x^2+2x+1", "(x+1)^2")                            # True (symbolic)
    await amath_equal(pred, gold)                                # from asyncio
    math_check(pred, gold)                                       # MathCheck(equal, status, detail)
    MathVerifier()(trajectory, task)                             # a Verifier: 1.0 / 0.0 / NaN

math-verify's SIGALRM works only on the main thread, so the work runs in worker processes with a
budget of CPU time, not wall time, so that a loaded machine does not score correct answers 0.
A comparison ends compared (`ok`), the answer's fault (`error`, `timeout`: scored 0, counted), or
unscorable: a worker that dies, cannot start or is starved of CPU raises `MathVerifyUnavailable`
(an `InfrastructureError`; `MathVerifier` returns NaN). docs/sandbox.md ("How math answers are
compared") has the rules and how answers are parsed.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import math
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from agentgrpo.env.rubric import VerifierResult
from agentgrpo.types import InfrastructureError, Task, Trajectory

_WORKER = r"""
import json, os, re, resource, struct, sys
import logging
logging.disable(logging.WARNING)  # math-verify warns that its timeouts are off: we enforce ours
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway sympy gets MemoryError
out = os.fdopen(os.dup(1), "wb", buffering=0)
inp = os.fdopen(os.dup(0), "rb", buffering=0)
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 0); os.dup2(devnull, 1)

def send(obj):
    data = json.dumps(obj).encode()
    out.write(struct.pack("!I", len(data)) + data)

def read(n):
    buf = b""
    while len(buf) < n:
        chunk = inp.read(n - len(buf))
        if not chunk:
            sys.exit(0)
        buf += chunk
    return buf

try:
    from math_verify import parse, verify
except Exception as e:  # say why, so the parent reports it instead of "exited"
    send({"ready": False, "e": f"{type(e).__name__}: {e}"[:200]})
    sys.exit(1)

def P(s):
    return parse(s, parsing_timeout=None)

DECIMAL_COMMA = re.compile(r"[+-]?[0-9]+,[0-9]+")

def equal(pred, gold):
    # math-verify reads a reference such as "1,22" as 1.22 (a decimal comma); boxed, it would be
    # the set {1, 22}. So one comma between digits is read as math-verify reads it.
    g = P(gold) if DECIMAL_COMMA.fullmatch(gold.strip()) else None
    g = g or P("\\boxed{" + gold + "}") or P(gold)
    if not g:
        return False
    p = P(pred)
    if not p and len(pred) < 300:
        p = P("$" + pred + "$")
    return bool(p) and bool(verify(g, p, timeout_seconds=None))

send({"ready": True})
while True:
    (n,) = struct.unpack("!I", read(4))
    req = json.loads(read(n))
    try:
        send({"r": equal(req["p"], req["a"])})
    except Exception as e:  # a parse/compare failure means "not shown equal"
        send({"r": False, "e": f"{type(e).__name__}: {e}"[:200]})
"""

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds used so far by process `pid`; None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name in (...) may hold spaces
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15
    except (OSError, IndexError, ValueError):
        return None


class MathVerifyUnavailable(InfrastructureError):
    """math-verify could not check an answer (its worker did not start, died, or was starved of
    CPU), after the retries. The sample is unscorable (reward NaN), never scored 0."""


@dataclass(frozen=True)
class MathCheck:
    """The outcome of one comparison.

    `status`: "ok" (compared: `equal` is the verdict), "error" (math-verify raised on this input:
    not equal) or "timeout" (the comparison used its whole CPU budget: not equal). `detail` says
    why for the last two. Infrastructure failures are not a status: they raise
    `MathVerifyUnavailable`.
    """

    equal: bool
    status: Literal["ok", "error", "timeout"] = "ok"
    detail: str = ""


class _WorkerFailed(Exception):
    """The worker could not answer: infrastructure. `retry`: whether a fresh worker may help."""

    def __init__(self, detail: str, retry: bool = True) -> None:
        super().__init__(detail)
        self.retry = retry


class _Worker:
    """One math-verify process; requests are answered in order, one at a time."""

    def __init__(self) -> None:
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _WORKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
        except OSError as e:  # fork/exec failed: out of processes, memory or descriptors
            raise _WorkerFailed(f"could not start a worker: {type(e).__name__}: {e}") from None
        self.ready = False

    def _read(self, deadline: float) -> dict | None:
        """The next message; None when the deadline passes first; raises if the worker exited."""
        fd = self.proc.stdout.fileno()
        buf = b""
        need = 4
        header = True
        while len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, need - len(buf))
            if not chunk:
                try:
                    code: int | str = self.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    code = "unknown"
                raise _WorkerFailed(f"the worker exited (code {code})")
            buf += chunk
            if header and len(buf) == 4:
                (need,) = struct.unpack("!I", buf)
                buf, header = b"", False
        return json.loads(buf)

    def start(self, timeout_s: float) -> None:
        """Wait for the worker's "ready" (it imports sympy first: about a second)."""
        if self.ready:
            return
        msg = self._read(time.monotonic() + timeout_s)
        if msg is None:
            raise _WorkerFailed(f"the worker did not start within {timeout_s:g} s")
        if not msg.get("ready"):
            raise _WorkerFailed(f"the worker could not load math-verify: {msg.get('e')}")
        self.ready = True

    def call(self, prediction: str, answer: str, timeout_s: float, wall_s: float) -> dict:
        """The worker's reply: {"r": bool} or {"r": False, "e": why}, or {"r": False, "timeout":
        CPU seconds} when the comparison used up `timeout_s` of CPU (kill the worker then).
        Raises `_WorkerFailed` when it could not answer: it died, or got less than `timeout_s`
        of CPU in `wall_s` (starved: retrying on this machine now would not help)."""
        data = json.dumps({"p": prediction, "a": answer}).encode()
        fd = self.proc.stdout.fileno()
        cpu0 = _cpu_s(self.proc.pid)
        t0 = time.monotonic()
        try:
            self.proc.stdin.write(struct.pack("!I", len(data)) + data)
            self.proc.stdin.flush()
        except OSError as e:
            raise _WorkerFailed(f"the worker's pipe broke: {type(e).__name__}") from None
        wait = timeout_s  # CPU time cannot run ahead of wall time: no point checking sooner
        while True:
            if select.select([fd], [], [], max(wait, 0.0))[0]:
                reply = self._read(time.monotonic() + wall_s)
                if reply is None:
                    raise _WorkerFailed("the worker stopped in the middle of its reply")
                return reply
            waited = time.monotonic() - t0
            cpu = _cpu_s(self.proc.pid)
            used = waited if cpu is None or cpu0 is None else cpu - cpu0
            if used >= timeout_s:
                return {"r": False, "timeout": used}
            if waited >= wall_s:
                raise _WorkerFailed(
                    f"the worker was starved: {used:.2f} s of CPU in {waited:.1f} s "
                    f"(budget {timeout_s:g} s); the machine is overloaded",
                    retry=False,
                )
            wait = min(max(timeout_s - used, 0.02), wall_s - waited)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            # A request whose write failed is still buffered: closing flushes it into the dead
            # pipe, and that BrokenPipeError would escape the retry that `_attempt` is doing.
            with contextlib.suppress(OSError):
                f.close()


class MathPool:
    """A bounded pool of math-verify worker processes with a result cache.

    Thread-safe; `check`/`equal` block the calling thread only (use `amath_check` from asyncio).
    `retries`: extra attempts on a fresh worker after one failed to start or died. `wall_factor`:
    how many times its CPU budget a comparison may take in wall time before its worker counts as
    starved. Counters: `timeouts` and `errors` (inputs scored 0), `failures` (failed attempts),
    `unscorable` (checks given up with `MathVerifyUnavailable`).
    """

    def __init__(
        self,
        workers: int | None = None,
        cache_size: int = 8192,
        start_timeout_s: float = 120.0,
        retries: int = 1,
        wall_factor: float = 4.0,
    ) -> None:
        if retries < 0 or wall_factor < 1.0:
            raise ValueError("MathPool: retries must be >= 0 and wall_factor >= 1")
        self.size = workers or max(1, min(4, os.cpu_count() or 1))
        self.start_timeout_s = start_timeout_s
        self.retries, self.wall_factor = retries, wall_factor
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(self.size)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], MathCheck] = OrderedDict()
        self._cache_size = cache_size
        self.timeouts = 0
        self.errors = 0
        self.failures = 0
        self.unscorable = 0

    def warm(self) -> None:
        """Start every worker now (each imports sympy: about a second), not on first use.

        Raises `MathVerifyUnavailable` when they cannot start: better at start-up than per sample.
        """
        workers: list[_Worker] = []
        try:
            for _ in range(self.size):
                workers.append(self._get())
            for w in workers:
                w.start(self.start_timeout_s)
        except _WorkerFailed as e:
            raise MathVerifyUnavailable(f"math-verify workers did not start: {e}") from None
        finally:
            for w in workers:
                if not w.ready:
                    w.kill()
                self._put(w if w.ready else None)

    def _get(self) -> _Worker:
        self._slots.acquire()
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        try:
            return _Worker()
        except _WorkerFailed:
            self._slots.release()
            raise

    def _put(self, w: _Worker | None) -> None:
        if w is not None:
            self._idle.put(w)
        self._slots.release()

    def _attempt(self, prediction: str, answer: str, timeout_s: float) -> dict:
        w = self._get()
        try:
            w.start(self.start_timeout_s)
            rep = w.call(prediction, answer, timeout_s, self.wall_factor * timeout_s)
        except BaseException:  # failed, starved or interrupted: its state is unknown
            w.kill()
            self._put(None)
            raise
        if "timeout" in rep:  # still computing: kill it; a fresh one starts on demand
            w.kill()
            self._put(None)
        else:
            self._put(w)
        return rep

    def check(self, prediction: str, answer: str, timeout_s: float = 5.0) -> MathCheck:
        """Compare `prediction` (model output) with the reference `answer`; see the module doc.

        Raises `MathVerifyUnavailable` when no worker could do it (infrastructure).
        """
        prediction, answer = str(prediction), str(answer)
        if prediction.strip() == answer.strip() and answer.strip():
            return MathCheck(True)
        key = (prediction, answer)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        failed, tries = "", 0
        while tries <= self.retries:
            if tries:
                time.sleep(min(0.05 * 2**tries, 1.0))  # the sandbox's backoff
            tries += 1
            try:
                rep = self._attempt(prediction, answer, timeout_s)
            except _WorkerFailed as e:
                failed = str(e)
                with self._lock:
                    self.failures += 1
                if not e.retry:
                    break
                continue
            if "timeout" in rep:  # not cached: another call may have a larger budget
                with self._lock:
                    self.timeouts += 1
                return MathCheck(
                    False,
                    "timeout",
                    f"math-verify used its {timeout_s:g} s CPU "
                    f"budget ({rep['timeout']:.2f} s) without an answer",
                )
            result = (
                MathCheck(False, "error", rep["e"]) if "e" in rep else MathCheck(bool(rep["r"]))
            )
            with self._lock:
                self.errors += "e" in rep
                self._cache[key] = result
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return result
        with self._lock:
            self.unscorable += 1
        raise MathVerifyUnavailable(
            f"math-verify could not check the answer (tries: {tries}): {failed}"
        )

    def equal(self, prediction: str, answer: str, timeout_s: float = 5.0) -> bool:
        """`check(...).equal`: False also for inputs that time out or make math-verify raise."""
        return self.check(prediction, answer, timeout_s).equal

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


_POOL: MathPool | None = None
_POOL_LOCK = threading.Lock()


def default_pool() -> MathPool:
    """The process-wide pool behind `math_equal` (created on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = MathPool()
            atexit.register(_POOL.close)
        return _POOL


def math_check(prediction: str, answer: str, timeout_s: float = 5.0) -> MathCheck:
    """`MathPool.check` on the default pool: the verdict and why (ok, error, timeout)."""
    return default_pool().check(prediction, answer, timeout_s)


async def amath_check(prediction: str, answer: str, timeout_s: float = 5.0) -> MathCheck:
    """`math_check` for asyncio code: runs in a thread, so the event loop never blocks."""
    return await asyncio.to_thread(math_check, prediction, answer, timeout_s)


def math_equal(prediction: str, answer: str, timeout_s: float = 5.0) -> bool:
    """True when `prediction` (model output, may contain `\\boxed{}`) equals the reference `answer`.

    Safe from any thread. False for a wrong answer, one math-verify raises on, and one that uses up
    `timeout_s` of CPU time (`math_check` tells these apart). Raises `MathVerifyUnavailable` when
    the answer could not be checked at all (workers failing or starved): that is not a False.
    """
    return default_pool().equal(prediction, answer, timeout_s)


async def amath_equal(prediction: str, answer: str, timeout_s: float = 5.0) -> bool:
    """`math_equal` for asyncio code: runs in a thread, so the event loop never blocks."""
    return await asyncio.to_thread(math_equal, prediction, answer, timeout_s)


class MathVerifier:
    """Verifier: 1.0 when the last assistant message's answer equals `task.answer`, else 0.0.

    NaN (unscorable, left out of its group, never 0) when the task has no answer or math-verify
    could not check it (`MathVerifyUnavailable`); `detail` says why, and also names a 0.0 that
    came from a timeout or a math-verify error.
    """

    def __init__(self, timeout_s: float = 5.0, pool: MathPool | None = None) -> None:
        self.timeout_s = timeout_s
        self.pool = pool

    def _last_answer(self, trajectory: Trajectory) -> str:
        return next((m.content for m in reversed(trajectory.messages) if m.role == "assistant"), "")

    def __call__(self, trajectory: Trajectory, task: Task) -> VerifierResult:
        if task.answer is None:
            return VerifierResult(math.nan, "the task has no reference answer")
        pool = self.pool or default_pool()
        try:
            res = pool.check(self._last_answer(trajectory), str(task.answer), self.timeout_s)
        except MathVerifyUnavailable as e:  # infrastructure: unscorable, with the reason
            return VerifierResult(math.nan, f"unscorable: {e}")
        detail = f"{res.status}: {res.detail}" if res.status != "ok" else ""
        return VerifierResult(float(res.equal), detail)
