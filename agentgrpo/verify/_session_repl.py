"""The Python REPL of a sandbox session: runs in the jail, as the session's user, for an episode.

Stdlib only: the session init starts it as `python -c <this source>`. It reads requests from fd 3
(a 4-byte big-endian length, then JSON `{"nonce": ..., "code": ...}`), runs each in one namespace
that lives as long as the REPL (names, imports and open files survive between calls), prints the
value of a final expression as the interactive interpreter does, and a traceback on an error.
Then it writes `\\n<nonce> <status>\\n` to stdout (the init's end-of-call marker; stdout and stderr
are one pipe): `ok`, `error`, or `exit:<code>` when the code raised SystemExit (the REPL lives on).
Stdin is /dev/null: the requests pipe is fd 3, so `input()` cannot eat them.
"""

from __future__ import annotations

import ast
import io
import json
import os
import struct
import sys
import traceback
import types


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _run(code: str, namespace: dict) -> str:
    """Run one request's code; its status word."""
    try:
        tree = ast.parse(code, "<session>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<session>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<session>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as e:
        code_ = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return f"exit:{code_}"
    except BaseException:  # noqa: BLE001 - the user's error: shown as the interpreter shows it
        etype, value, tb = sys.exc_info()
        traceback.print_exception(etype, value, tb.tb_next if tb is not None else None)
        return "error"
    return "ok"


def main() -> None:
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), "utf-8", "backslashreplace", write_through=True
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    main_mod = types.ModuleType("__main__")
    sys.modules["__main__"] = main_mod
    namespace = main_mod.__dict__
    sys.path.insert(0, os.getcwd())
    while True:
        try:
            (n,) = struct.unpack("!I", _read_exact(3, 4))
            req = json.loads(_read_exact(3, n))
        except EOFError:
            return
        status = _run(req["code"], namespace)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - the user may have replaced or closed them
                pass
        os.write(1, f"\n{req['nonce']} {status}\n".encode())


if __name__ == "__main__":  # `python -c <this source>` in the jail
    main()
