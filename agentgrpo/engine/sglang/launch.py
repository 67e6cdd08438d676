"""Start an SGLang server for RL, wait until it is ready, stop it with the run.

`agentgrpo serve-sglang MODEL [sglang args]` runs `python -m sglang.launch_server` in the foreground
until Ctrl-C; `SGLangServer` does the same as a context manager for the training loop:

    with SGLangServer("Qwen/Qwen2.5-0.5B-Instruct", extra_args=["--tp-size", "2"]) as server:
        engine = SGLangEngine([server.url])

What the launcher adds to SGLang's own defaults, and why:
- `--host 127.0.0.1` unless `--host` is given: a server can be driven (and its weights replaced)
  by whoever reaches it, so it listens on loopback by default. Binding another address warns when no
  API key is set.
- `--api-key` from the environment variable `SGLANG_API_KEY` when set and not given explicitly (it
  is masked whenever the command is printed).
- `SGLANG_RETURN_ORIGINAL_LOGPROB` is removed from the server's environment: with it SGLang returns
  temperature-1 logprobs, while rollouts record the logprobs of the distribution they sampled from.
Everything else (tensor parallelism, memory fraction, context length, ...) is the user's, passed
through unchanged. The readiness wait polls `/health_generate` (200 once the model is loaded and
warmed up) while watching the process, as SGLang's own adapter, verl and slime do.
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

DEFAULT_PORT = 30000
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
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    module: str = "sglang.launch_server",
) -> list[str]:
    """The server command line: RL defaults first, then the user's arguments (which win)."""
    given = _given(extra_args)
    cmd = [sys.executable, "-m", module, "--model-path", model]
    if "--host" not in given:
        cmd += ["--host", host]
    if "--port" not in given:
        cmd += ["--port", str(port)]
    if api_key and "--api-key" not in given:
        cmd += ["--api-key", api_key]
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


class SGLangServer:
    """One SGLang server process: started on `start()`/`with`, stopped on `stop()`/block exit.

    Example:
        ```python
        with SGLangServer("Qwen/Qwen2.5-0.5B-Instruct", port=30000, ready_timeout_s=900) as srv:
            engine = SGLangEngine([srv.url])
            ...
        ```

    `port=0` picks a free port. `log_path` sends the server's output to a file (and quotes its
    last lines if startup fails); otherwise it goes to this process's stdout/stderr. `module` is
    the Python module run with `-m` (tests run the fake server through the same code).
    """

    def __init__(
        self,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 900.0,
        log_path: str | os.PathLike[str] | None = None,
        api_key_env: str = "SGLANG_API_KEY",
        module: str = "sglang.launch_server",
    ) -> None:
        extra_args = list(extra_args)
        port = int(_value(extra_args, "--port") or port) or _free_port()
        host = _value(extra_args, "--host") or host
        extra_args = _without(extra_args, ("--host", "--port"))  # resolved above, passed below
        self.api_key = _value(extra_args, "--api-key") or os.environ.get(api_key_env) or None
        self.command = build_command(
            model, extra_args, host=host, port=port, api_key=self.api_key, module=module
        )
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{connect_host}:{port}"
        self.ready_timeout_s = ready_timeout_s
        self.log_path = Path(log_path) if log_path is not None else None
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        if host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            print(
                f"warning: SGLang will listen on {host} without an API key: anyone who reaches "
                f"it can generate and replace its weights (set {api_key_env})",
                file=sys.stderr,
            )

    def start(self) -> str:
        """Start the process and wait until it serves; returns the URL."""
        env = dict(os.environ)
        if env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None) not in (None, "", "0", "false"):
            print(
                "warning: SGLANG_RETURN_ORIGINAL_LOGPROB removed from the server's environment "
                "(rollout logprobs must be those of the sampling distribution)",
                file=sys.stderr,
            )
        out: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        print(f"starting SGLang: {masked(self.command)}", file=sys.stderr)
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
        """Poll `/health_generate` until 200, failing fast if the process exits."""
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            while True:
                rc = self.process.poll()
                if rc is not None:
                    raise RuntimeError(
                        f"SGLang exited with code {rc} during startup{self._log_tail()}"
                    )
                try:
                    r = client.get(f"{self.url}/health_generate")
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:  # not listening yet: keep polling
                    last = type(e).__name__
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"SGLang at {self.url} not ready after {self.ready_timeout_s:.0f}s "
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

    def __enter__(self) -> SGLangServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> SGLangServer:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)


def main(argv: Sequence[str] | None = None) -> int:
    """`agentgrpo serve-sglang MODEL [--ready-timeout S] [--log-file F] [sglang args ...]`."""
    ap = argparse.ArgumentParser(
        prog="agentgrpo serve-sglang",
        description="Start an SGLang server with the settings RL needs, wait until it is ready, "
        "and keep it running until Ctrl-C. Arguments after MODEL that are not listed here go to "
        "sglang.launch_server unchanged (e.g. --tp-size 2 --port 30001).",
    )
    ap.add_argument("model", help="model path or hub id (SGLang's --model-path)")
    ap.add_argument(
        "--ready-timeout", type=float, default=900.0, help="seconds to wait for readiness"
    )
    ap.add_argument("--log-file", default=None, help="write the server's output to this file")
    ap.add_argument("--sglang-module", default="sglang.launch_server", help=argparse.SUPPRESS)
    args, sglang_args = ap.parse_known_args(argv)
    server = SGLangServer(
        args.model,
        extra_args=sglang_args,
        ready_timeout_s=args.ready_timeout,
        log_path=args.log_file,
        module=args.sglang_module,
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
        print(f"SGLang ready at {server.url}", flush=True)
        while not stopping and server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
        if not stopping:
            rc = server.process.returncode if server.process else 1
            print(f"error: SGLang exited with code {rc}", file=sys.stderr)
            return rc or 1
        return 0
    finally:
        server.stop()
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
