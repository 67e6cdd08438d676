"""The harness of `agentgrpo.verify.code`: a script sent to the sandbox as source, never imported.

The parent reads the spec, forks a child per test and prints one JSON line per finished test (so a
job killed at its wall limit still reports the tests it finished). docs/sandbox.md ("How the code
harness runs tests") says what the child guards against.
"""

import ast
import atexit
import base64
import ctypes
import json
import math
import os
import resource
import select
import signal
import sys
import time
import types

spec = json.load(open("_spec.json"))
os.unlink("_spec.json")
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: children cannot open our /proc fds
solution, cap, per_test = spec["solution"], spec["capture_bytes"], spec["timeout_s"]
wall_per_test = spec["wall_s"]
out = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 1)
# Bound before any solution runs, so patching json, os or builtins cannot change a report or a
# check; the solution cannot reach them either: it runs as a fresh `__main__` module (so `import
# __main__` is its own namespace, as under `python prog.py`), not in this harness's.
_write, _exit, _type, _isinstance, _getattr = os.write, os._exit, type, isinstance, getattr
# type's own descriptors: a metaclass's __getattribute__ cannot fake a class's flags, MRO or dict
_flags, _mro = type.__dict__["__flags__"].__get__, type.__dict__["__mro__"].__get__
_vars, _tname = type.__dict__["__dict__"].__get__, type.__dict__["__name__"].__get__
_SCALARS = (int, float, complex, bool, str, bytes, type(None))
_CONTAINERS = (list, tuple, set, frozenset, dict)
_DUNDERS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__")
_PYTHON_CLASS = (1 << 9) | (1 << 8)  # Py_TPFLAGS_HEAPTYPE | Py_TPFLAGS_IMMUTABLETYPE


class _Rigged(Exception):
    pass


def _own(cls, name):  # the attribute instances see (the class's MRO, not its metaclass)
    return next((_vars(k)[name] for k in _mro(cls) if name in _vars(k)), None)


def _plain(value):
    # An operand of an assert's comparison: reject objects whose class (Python code, so possibly the
    # solution's) defines its own comparison or truth, e.g. an __eq__ that is always True, also
    # inside containers. Classes written in C (int, list, numpy's) cannot be redefined by a
    # solution.
    todo, seen = [value], 0
    while todo and seen < 100000:
        v = todo.pop()
        seen += 1
        t = _type(v)
        if t in _SCALARS:
            continue
        if _flags(t) & _PYTHON_CLASS == 1 << 9:  # compare with its nearest C-implemented ancestor
            base = next(b for b in _mro(t) if _flags(b) & _PYTHON_CLASS != 1 << 9)
            for name in _DUNDERS:
                if _own(t, name) is not _own(base, name):
                    raise _Rigged(
                        f"compared a {_tname(t)}, whose class defines its own {name} (an assert "
                        "compares plain values)"
                    )
        if _isinstance(v, dict):
            todo += list(v.keys()) + list(v.values())
        elif _isinstance(v, _CONTAINERS):
            todo += list(v)
        elif (
            _tname(t) == "ndarray"
            and _getattr(v, "dtype", None) is not None
            and v.dtype.kind == "O"
        ):
            todo += list(v.flat)
    return value


class _GuardAsserts(ast.NodeTransformer):
    # Every comparison inside an assert gets its operands checked by _plain; a bare `assert x` or
    # `assert not x` gets x checked (its truth could be rigged the same way).
    def visit_Assert(self, node):
        node.test = self._guard(node.test)
        return node

    def _guard(self, e):
        if _isinstance(e, ast.Compare) or not _isinstance(e, (ast.BoolOp, ast.UnaryOp)):
            e = _Compares().visit(e)
            return e if _isinstance(e, ast.Compare) else _call(e)
        if _isinstance(e, ast.BoolOp):
            e.values = [self._guard(v) for v in e.values]
        else:
            e.operand = self._guard(e.operand)
        return e


class _Compares(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        node.left, node.comparators = _call(node.left), [_call(c) for c in node.comparators]
        return node


def _call(e):
    return ast.copy_location(ast.Call(ast.Name("__agentgrpo_plain__", ast.Load()), [e], []), e)


def _compile_test(code):
    tree = _GuardAsserts().visit(ast.parse(code, "<test>"))
    return compile(ast.fix_missing_locations(tree), "<test>", "exec")


def _end_program():
    # What `python prog.py` does after its last line: wait for its non-daemon threads (a solution
    # may work in a big-stack thread it never joins), then run its atexit handlers.
    threading = sys.modules.get("threading")
    while threading is not None:
        left = [
            t
            for t in threading.enumerate()
            if t is not threading.current_thread() and not t.daemon and t.is_alive()
        ]
        if not left:
            break
        for t in left:
            t.join()
    atexit._run_exitfuncs()


def child(test, wfd, nonce):
    def send(
        outcome, detail=""
    ):  # "nonce\noutcome\ndetail": no encoder a solution could have patched
        _write(wfd, (nonce + "\n" + outcome + "\n" + detail[-500:]).encode("utf-8", "replace"))

    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    ns = main.__dict__
    ns["__builtins__"] = __builtins__
    io = test["kind"] == "io"
    try:
        test_code = None if io else _compile_test(test["code"])
        try:
            exec(compile(solution, "<solution>", "exec"), ns)
        except (
            SystemExit
        ) as e:  # a program may end itself with sys.exit(0); a function under test may not
            if not io or e.code not in (None, 0):
                raise
        if io:
            _end_program()
        else:
            # The test's own globals: the solution's names plus the guard, which the solution (whose
            # functions keep `ns` as their globals) can therefore neither see nor rebind.
            exec(test_code, dict(ns, __agentgrpo_plain__=_plain))
    except _Rigged as e:
        send("failed", "rigged comparison: " + str(e))
    except AssertionError as e:
        send("failed", "AssertionError: " + str(e))
    except SystemExit as e:
        send("error", f"exited before the test finished (SystemExit: {e.code!r})")
    except BaseException as e:
        send("error", f"{_type(e).__name__}: {e}")
    else:
        send("ran" if io else "passed")
    try:
        sys.stdout.flush()
    except Exception:
        pass
    _exit(0)


def _fork_child(test, pipes, nonce):
    """Fork the test's child (its CPU budget set, its stdio on `pipes`, the report pipe left open)
    and close the child's ends here; the child never returns."""
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        # The test's budget is CPU time, as judges count it, so a loaded machine does not fail a
        # correct solution. ITIMER_PROF ends the process at the budget (SIGPROF's default action);
        # a solution that resets it still meets RLIMIT_CPU, whose hard limit it cannot raise.
        signal.setitimer(signal.ITIMER_PROF, per_test)
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        lim = (math.ceil(per_test), math.ceil(per_test) + 1)
        resource.setrlimit(
            resource.RLIMIT_CPU,
            lim if hard == resource.RLIM_INFINITY else tuple(min(x, hard) for x in lim),
        )
        for fd, std in ((pipes[0][0], 0), (pipes[1][1], 1), (pipes[2][1], 2)):
            os.dup2(fd, std)
        rep = pipes[3][1]
        for fd in [devnull, out.fileno()] + [fd for p in pipes for fd in p if fd != rep]:
            os.close(fd)
        sys.stdin, sys.stdout, sys.stderr = (
            open(0, closefd=False),
            open(1, "w", closefd=False),
            open(2, "w", closefd=False),
        )
        child(test, rep, nonce)
    for fd in (pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]):
        os.close(fd)
    return pid


def _pump(pid, pipes, pending):
    """Write `pending` to the child's stdin and read its stdout, stderr and report pipes (each
    kept to `cap` bytes) until it exits or its wall backstop passes. Returns the three buffers,
    whether it exited, whether it timed out, and the descriptors left to close."""
    stdin_fd = pipes[0][1]
    os.set_blocking(stdin_fd, False)
    bufs = {pipes[1][0]: b"", pipes[2][0]: b"", pipes[3][0]: b""}
    live = set(bufs)
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + wall_per_test  # a backstop for a test that sleeps or blocks
    exited = timed_out = False
    while not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        writers = [stdin_fd] if stdin_fd >= 0 else []
        readable, writable, _ = select.select(list(live) + [pidfd], writers, [], left)
        if writable:
            try:
                pending = pending[os.write(stdin_fd, pending[:65536]) :]
            except OSError:
                pending = b""
            if not pending:
                os.close(stdin_fd)
                stdin_fd = -1
        for fd in readable:
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                live.discard(fd)
            elif len(bufs[fd]) < cap:  # keep reading past the cap so the child never blocks
                bufs[fd] += chunk[: cap - len(bufs[fd])]
    for fd in live:  # what the child wrote before it ended; grandchildren may keep pipes open
        os.set_blocking(fd, False)
        try:
            while len(bufs[fd]) < cap and (chunk := os.read(fd, 65536)):
                bufs[fd] += chunk[: cap - len(bufs[fd])]
        except BlockingIOError:
            pass
    fds = [pidfd] + list(bufs) + ([stdin_fd] if stdin_fd >= 0 else [])
    return list(bufs.values()), exited, timed_out, fds


def _reap(pid):
    """Kill the child's process group and reap it: (wait status, CPU seconds of the child and of
    its reaped descendants)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # the child left its process group: kill it by pid, or waitpid below would wait
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _, status, usage = os.wait4(pid, 0)
    return status, usage.ru_utime + usage.ru_stime


def _verdict(test, nonce, stderr, report, status, cpu, exited, timed_out):
    """The test's (outcome, detail): its CPU or wall budget first, then the child's own report
    (only if it starts with the nonce), then how the child ended."""
    head, _, text = report.decode("utf-8", "replace").partition("\n")
    outcome, _, detail = text.partition("\n") if head == nonce else ("", "", "")
    over_cpu = cpu > per_test or (
        os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGPROF, signal.SIGXCPU)
    )
    if over_cpu:
        return "timeout", f"over {per_test:g}s of CPU"
    if timed_out:
        return "timeout", (
            f"over {wall_per_test:g}s of wall time ({cpu:.2f}s of CPU): it sleeps or blocks"
        )
    if outcome:
        return outcome, detail
    clean_exit = exited and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    if test["kind"] == "io" and clean_exit:  # os._exit(0) after printing, as a program may
        return "ran", ""
    if report:
        return "error", "the report pipe held something the harness did not write"
    tail = stderr.decode("utf-8", "replace")[-300:]
    return "error", ("exited before the test finished; " + tail).strip()


def run_one(i, test):
    # The report pipe is open in the child while the solution runs, so the solution can write to it;
    # a report counts only if it starts with this test's nonce, which lives in frames' locals alone.
    nonce = os.urandom(16).hex()
    pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, report
    pid = _fork_child(test, pipes, nonce)
    (stdout, stderr, report), exited, timed_out, fds = _pump(
        pid, pipes, test.get("stdin", "").encode()
    )
    status, cpu = _reap(pid)
    for fd in fds:
        os.close(fd)
    outcome, detail = _verdict(test, nonce, stderr, report, status, cpu, exited, timed_out)
    res = {"i": i, "o": outcome, "d": detail, "cpu": round(cpu, 4)}
    if test["kind"] == "io":  # raw bytes: JSON's escapes would make the size unbounded by `cap`
        res["out"] = base64.b64encode(stdout).decode()
    out.write(json.dumps(res) + "\n")
    out.flush()


for i, test in enumerate(spec["tests"]):
    run_one(i, test)
