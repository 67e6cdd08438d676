"""Math answer checking with `math-verify`, safe from any thread or asyncio task, never hanging.

    math_equal("so the answer is \\boxed{\\frac{1}{2}}", "0.5")   # True
    math_equal("x^2+2x+1", "(x+1)^2")                            # True (symbolic)
    await amath_equal(pred, gold)                                # from asyncio
    MathVerifier()(trajectory, task)                             # a Verifier: 1.0 / 0.0

Why a process pool: math-verify bounds its own work with SIGALRM, which only works on the main
thread (it raises elsewhere), and sympy can run away on inputs like `10^{10^{10}}`. So its
timeouts are disabled and the work runs in worker processes; the caller waits at most
`timeout_s`, and a worker that overruns is killed and replaced. A timeout counts as "not equal"
(the model's answer could not be shown equal in time) and is counted in `MathPool.timeouts`.

How answers are read: the reference is parsed as if boxed (`\\boxed{answer}`), so bare LaTeX
(`\\sqrt{8}`) and plain numbers both work; the prediction is parsed as math-verify reads model
output (last `\\boxed{}` first, then LaTeX and plain expressions) and, when nothing is found in
a short prediction, as an inline formula. `verify(gold, prediction)` then compares symbolically
and numerically (fractions vs decimals, percentages, intervals, sets, equations `x=2` vs `2`).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict

from agentgrpo.types import Task, Trajectory

_WORKER = r"""
import json, os, resource, struct, sys
import logging
logging.disable(logging.WARNING)  # math-verify warns that its timeouts are off: we enforce ours
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway sympy gets MemoryError
out = os.fdopen(os.dup(1), "wb", buffering=0)
inp = os.fdopen(os.dup(0), "rb", buffering=0)
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 0); os.dup2(devnull, 1)
from math_verify import parse, verify

def P(s):
    return parse(s, parsing_timeout=None)

def equal(pred, gold):
    g = P("\\boxed{" + gold + "}") or P(gold)
    if not g:
        return False
    p = P(pred)
    if not p and len(pred) < 300:
        p = P("$" + pred + "$")
    return bool(p) and bool(verify(g, p, timeout_seconds=None))

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

send({"ready": True})
while True:
    (n,) = struct.unpack("!I", read(4))
    req = json.loads(read(n))
    try:
        send({"r": equal(req["p"], req["a"])})
    except Exception as e:  # a parse/compare failure means "not shown equal"
        send({"r": False, "e": f"{type(e).__name__}: {e}"[:200]})
"""


class _Worker:
    """One math-verify process; requests are answered in order, one at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
        self.ready = False

    def _read(self, deadline: float) -> dict | None:
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
                return None
            buf += chunk
            if header and len(buf) == 4:
                (need,) = struct.unpack("!I", buf)
                buf, header = b"", False
        return json.loads(buf)

    def call(
        self, prediction: str, answer: str, timeout_s: float, start_timeout_s: float
    ) -> dict | None:
        """The worker's reply, or None if it did not answer in time (then it must be killed)."""
        if not self.ready:
            if self._read(time.monotonic() + start_timeout_s) is None:
                return None
            self.ready = True
        data = json.dumps({"p": prediction, "a": answer}).encode()
        try:
            self.proc.stdin.write(struct.pack("!I", len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self._read(time.monotonic() + timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class MathPool:
    """A bounded pool of math-verify worker processes with a result cache.

    Thread-safe; `equal` blocks the calling thread only (use `amath_equal` from asyncio).
    """

    def __init__(
        self, workers: int | None = None, cache_size: int = 8192, start_timeout_s: float = 120.0
    ) -> None:
        self.size = workers or max(1, min(4, os.cpu_count() or 1))
        self.start_timeout_s = start_timeout_s
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(self.size)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._cache_size = cache_size
        self.timeouts = 0
        self.errors = 0

    def warm(self) -> None:
        """Start every worker now (each imports sympy: about a second), not on first use."""
        workers = [self._get() for _ in range(self.size)]
        for w in workers:
            if not w.ready and w._read(time.monotonic() + self.start_timeout_s) is not None:
                w.ready = True
        for w in workers:
            self._put(w)

    def _get(self) -> _Worker:
        self._slots.acquire()
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return _Worker()

    def _put(self, w: _Worker | None) -> None:
        if w is not None:
            self._idle.put(w)
        self._slots.release()

    def equal(self, prediction: str, answer: str, timeout_s: float = 5.0) -> bool:
        prediction, answer = str(prediction), str(answer)
        if prediction.strip() == answer.strip() and answer.strip():
            return True
        key = (prediction, answer)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        w = self._get()
        try:
            rep = w.call(prediction, answer, timeout_s, self.start_timeout_s)
        except BaseException:
            w.kill()
            self._put(None)
            raise
        if rep is None:  # overran (or died): kill it; a fresh one starts on demand
            w.kill()
            self._put(None)
            with self._lock:
                self.timeouts += 1
            return False
        self._put(w)
        result = bool(rep["r"])
        with self._lock:
            self.errors += "e" in rep
            self._cache[key] = result
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return result

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
            import atexit

            atexit.register(_POOL.close)
        return _POOL


def math_equal(prediction: str, answer: str, timeout_s: float = 5.0) -> bool:
    """True when `prediction` (model output, may contain `\\boxed{}`) equals the reference `answer`.

    Safe from any thread; returns within about `timeout_s` (False on timeout) once a worker is free.
    """
    return default_pool().equal(prediction, answer, timeout_s)


async def amath_equal(prediction: str, answer: str, timeout_s: float = 5.0) -> bool:
    """`math_equal` for asyncio code: runs in a thread, so the event loop never blocks."""
    return await asyncio.to_thread(math_equal, prediction, answer, timeout_s)


class MathVerifier:
    """Verifier: 1.0 when the last assistant message's answer equals `task.answer`, else 0.0.

    A task without an answer cannot be scored: NaN (left out of its group), never 0.
    """

    def __init__(self, timeout_s: float = 5.0, pool: MathPool | None = None) -> None:
        self.timeout_s = timeout_s
        self.pool = pool

    def _last_answer(self, trajectory: Trajectory) -> str:
        return next((m.content for m in reversed(trajectory.messages) if m.role == "assistant"), "")

    def __call__(self, trajectory: Trajectory, task: Task) -> float:
        if task.answer is None:
            return float("nan")
        pool = self.pool or default_pool()
        return float(pool.equal(self._last_answer(trajectory), str(task.answer), self.timeout_s))
