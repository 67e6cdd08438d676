"""Start an inference server (SGLang, vLLM) for RL, wait until it is ready, stop it with the run.

`ServerProcess` runs the server's module with `-m` as a subprocess in its own process group and
polls its health path while watching the process; `serve_main` is the foreground command behind
`agentgrpo serve-sglang` and `serve-vllm` (until Ctrl-C). Each engine's subclass
(`sglang/launch.py`, `vllm/launch.py`) says which module, which flags RL needs by default and
what the server's environment must (not) hold. Shared defaults, and why:
- `--host 127.0.0.1` unless `--host` is given: a server can be driven (and its weights replaced)
  by whoever reaches it, so it listens on loopback by default. Binding another address warns when
  no API key is set.
- `--api-key` from the engine's environment variable when set and not given explicitly (it is
  masked whenever the command is printed).
Everything else (parallelism, memory, context length, ...) is the user's, passed through unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx

_MASKED_FLAGS = ("--api-key", "--admin-api-key")


def _given(args: Sequence[str]) -> set[str]:
    """Option names present in `args` (`--port 1` and `--port=1` alike)."""
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def _value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _without(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def build_command(
    model: str,
    extra_args: Sequence[str] = (),
    *,
    host: str,
    port: int,
    api_key: str | None,
    module: str,
    model_flag: str,
    rl_args: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """The server command line: RL defaults first, then the user's arguments (which win);
    `rl_args` are flags the engine adds unless the user gave them (each a flag, maybe a value)."""
    given = _given(extra_args)
    cmd = [python or sys.executable, "-m", module, model_flag, model]
    if "--host" not in given:
        cmd += ["--host", host]
    if "--port" not in given:
        cmd += ["--port", str(port)]
    if api_key and "--api-key" not in given:
        cmd += ["--api-key", api_key]
    i = 0
    while i < len(rl_args):  # a flag, then its value unless the next item is a flag
        flag = rl_args[i]
        n = 2 if i + 1 < len(rl_args) and not rl_args[i + 1].startswith("--") else 1
        if flag not in given:
            cmd += list(rl_args[i : i + n])
        i += n
    return cmd + list(extra_args)


def masked(cmd: Sequence[str]) -> str:
    """The command as text with API keys replaced by ***."""
    out, hide = [], False
    for a in cmd:
        if hide:
            out.append("***")
        elif a.startswith(tuple(f + "=" for f in _MASKED_FLAGS)):
            out.append(a.split("=", 1)[0] + "=***")
        else:
            out.append(a)
        hide = a in _MASKED_FLAGS
    return " ".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server process: started on `start()`/`with`, stopped on `stop()`/block exit. A
    subclass sets the class attributes below and may adjust `rl_args` and `server_env`.

    `port=0` picks a free port. `log_path` sends the server's output to a file (and quotes its
    last lines if startup fails); otherwise it goes to this process's stdout/stderr. `module` is
    the Python module run with `-m` (tests run fake servers through the same code), `python` the
    interpreter (default: this one; a server in a venv of its own, e.g. `.venv-vllm/bin/python`).
    """

    name = "server"  # in messages: "SGLang", "vLLM"
    default_module = ""
    default_port = 8000
    model_flag = "--model"
    health_path = "/health"
    default_api_key_env = ""

    def __init__(
        self,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 900.0,
        log_path: str | os.PathLike[str] | None = None,
        api_key_env: str | None = None,
        module: str | None = None,
        python: str | None = None,
    ) -> None:
        extra_args = list(extra_args)
        api_key_env = api_key_env or self.default_api_key_env
        port = self.default_port if port is None else port
        port = int(_value(extra_args, "--port") or port) or _free_port()
        host = _value(extra_args, "--host") or host
        extra_args = _without(extra_args, ("--host", "--port"))  # resolved above, passed below
        self.api_key = _value(extra_args, "--api-key") or os.environ.get(api_key_env) or None
        self.command = build_command(
            model,
            extra_args,
            host=host,
            port=port,
            api_key=self.api_key,
            module=module or self.default_module,
            model_flag=self.model_flag,
            rl_args=self.rl_args(),
            python=python,
        )
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{connect_host}:{port}"
        self.ready_timeout_s = ready_timeout_s
        self.log_path = Path(log_path) if log_path is not None else None
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        if host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            print(
                f"warning: {self.name} will listen on {host} without an API key: anyone who "
                f"reaches it can generate and replace its weights (set {api_key_env})",
                file=sys.stderr,
            )

    def rl_args(self) -> list[str]:
        """Flags RL needs that the engine's defaults lack (added unless the user gave them)."""
        return []

    def server_env(self, env: dict[str, str]) -> dict[str, str]:
        """The server's environment, from this process's."""
        return env

    def start(self) -> str:
        """Start the process and wait until it serves; returns the URL."""
        env = self.server_env(dict(os.environ))
        out: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        print(f"starting {self.name}: {masked(self.command)}", file=sys.stderr)
        self.process = subprocess.Popen(
            self.command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # its own process group: stop() reaches TP workers too
        )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def wait_ready(self) -> None:
        """Poll the health path until 200, failing fast if the process exits."""
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            while True:
                rc = self.process.poll()
                if rc is not None:
                    raise RuntimeError(
                        f"{self.name} exited with code {rc} during startup{self._log_tail()}"
                    )
                try:
                    r = client.get(f"{self.url}{self.health_path}")
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:  # not listening yet: keep polling
                    last = type(e).__name__
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.name} at {self.url} not ready after {self.ready_timeout_s:.0f}s "
                        f"(last: {last}){self._log_tail()}"
                    )
                time.sleep(1.0)

    def _log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_bytes().decode("utf-8", "replace").splitlines()[-lines:]
        return f"; last log lines of {self.log_path}:\n" + "\n".join(tail)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; returns the exit code."""
        p = self.process
        rc = None
        if p is not None:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    rc = p.wait(grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    rc = p.wait()
                except ProcessLookupError:  # it exited between poll() and killpg()
                    rc = p.wait()
            else:
                rc = p.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> ServerProcess:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)


def serve_main(
    server_cls: type[ServerProcess], ap: argparse.ArgumentParser, argv: Sequence[str] | None
) -> int:
    """The foreground command: parse `ap` (the engine's, with `model`, `--ready-timeout`,
    `--log-file`, `--module` and `--python` added here), start the server, wait until Ctrl-C."""
    ap.add_argument(
        "--ready-timeout", type=float, default=900.0, help="seconds to wait for readiness"
    )
    ap.add_argument("--log-file", default=None, help="write the server's output to this file")
    ap.add_argument("--module", default=None, help=argparse.SUPPRESS)
    args, server_args = ap.parse_known_args(argv)
    server = server_cls(
        args.model,
        extra_args=server_args,
        ready_timeout_s=args.ready_timeout,
        log_path=args.log_file,
        module=args.module,
        python=getattr(args, "python", None),
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def abort_startup(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # start() stops the half-started server on the way out

    old = {s: signal.signal(s, abort_startup) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.start()
        except (RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        for s in old:
            signal.signal(s, on_signal)
        print(f"{server.name} ready at {server.url}", flush=True)
        while not stopping and server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
        if not stopping:
            rc = server.process.returncode if server.process else 1
            print(f"error: {server.name} exited with code {rc}", file=sys.stderr)
            return rc or 1
        return 0
    finally:
        server.stop()
        for s, h in old.items():
            signal.signal(s, h)
