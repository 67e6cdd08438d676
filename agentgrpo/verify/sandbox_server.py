"""`agentgrpo serve-sandbox`: the sandbox as an HTTP server for trainers on other machines.

    agentgrpo serve-sandbox --host 0.0.0.0 --port 8765   # token in $AGENTGRPO_SANDBOX_TOKEN
    AGENTGRPO_SANDBOX_URL=http://box1:8765,http://box2:8765 agentgrpo train ...  # the trainer

It runs code for whoever reaches it: it binds 127.0.0.1 unless given a bearer token (from the
environment or --token-file, never the command line), checks the token in constant time, bounds
the connections waiting for their request head (`_Gate`) and the bodies parsed at once
(`_ByteBudget`), clamps every limit a request asks for to the server's maxima, and admits at most
--max-queue jobs (429 beyond). A client that hangs up has its job killed. Stdlib only
(`http.server`, one thread per connection). Endpoints: GET /health, POST /run, and
SandboxFusion's POST /run_code (`_server_api.py` holds the request and answer shapes).
docs/sandbox.md describes the endpoints; docs/security.md has the threat model and its tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agentgrpo.verify._records import ExecResult, Limits
from agentgrpo.verify._server_api import (  # the request and answer shapes, re-exported
    SANDBOXFUSION_OUTPUT_BYTES,
    BadRequest,
    ServerLimits,
    parse_run,
    parse_run_code,
    to_sandboxfusion,
)
from agentgrpo.verify.sandbox import Sandbox, SandboxConfig

TOKEN_ENV = "AGENTGRPO_SANDBOX_TOKEN"
_Request = tuple[str, bytes, dict[str, bytes], Limits]  # code, stdin, files, limits
__all__ = [
    "SANDBOXFUSION_OUTPUT_BYTES",
    "TOKEN_ENV",
    "BadRequest",
    "ServerLimits",
    "build_parser",
    "main",
    "make_handler",
    "make_server",
    "parse_run",
    "parse_run_code",
    "to_sandboxfusion",
]


class _Gate:
    """The connections that have not sent a complete request head yet (new ones, and idle
    keep-alive ones between requests), which are neither authenticated nor doing work: at most
    `max_waiting` of them, each for at most `head_timeout_s` (a deadline for the whole head, so a
    client dripping a byte at a time gets no longer). Past either bound the oldest is shut down, so
    idle or slow connections can neither hold every thread and descriptor nor keep a request that
    arrives after them from being read."""

    def __init__(self, max_waiting: int, head_timeout_s: float) -> None:
        self.max_waiting, self.head_timeout_s = max_waiting, head_timeout_s
        self._since: dict[socket.socket, float] = {}  # insertion order: the oldest first
        self._lock = threading.Lock()

    def waiting(self, conn: socket.socket) -> None:
        with self._lock:
            self._since.pop(conn, None)
            self._since[conn] = time.monotonic()
            self._shed()

    def arrived(self, conn: socket.socket) -> None:
        with self._lock:
            self._since.pop(conn, None)

    def sweep(self) -> None:
        with self._lock:
            self._shed()

    def _shed(self) -> None:
        now = time.monotonic()
        while self._since:
            conn, since = next(iter(self._since.items()))
            if len(self._since) <= self.max_waiting and now - since < self.head_timeout_s:
                return
            del self._since[conn]
            try:  # its thread, blocked reading the head, reads EOF and ends
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _ByteBudget:
    """At most `limit` bytes of request bodies held for parsing at once."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout: float) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self.used + n <= self.limit, timeout):
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class _Server(ThreadingHTTPServer):
    """`ThreadingHTTPServer` whose waiting connections are bounded (`_Gate`, swept between
    accepts, at least every 0.5 s) and whose connection errors are one line, not a traceback."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of connections is accepted, then shed

    def __init__(
        self, address: tuple, handler: type[BaseHTTPRequestHandler], gate: _Gate, ipv6: bool
    ) -> None:
        self.gate = gate
        self.address_family = socket.AF_INET6 if ipv6 else socket.AF_INET
        super().__init__(address, handler)

    def service_actions(self) -> None:
        self.gate.sweep()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # a client gone, timed out or shed: not the server's fault
            sys.stderr.write(f"serve-sandbox: {client_address[0]}: {type(exc).__name__}: {exc}\n")
        else:
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """One connection's requests. The server's state (sandbox, token, limits, gate, admission and
    parse budgets) is bound as class attributes by `make_handler`."""

    protocol_version = "HTTP/1.1"
    server_version = "agentgrpo-sandbox"
    sb: Sandbox
    token: str | None
    srv: ServerLimits
    gate: _Gate
    admitted: threading.BoundedSemaphore
    parsing: _ByteBudget

    def handle_one_request(self) -> None:
        self.gate.waiting(self.connection)  # until its head is read (`do_GET` / `do_POST`)
        try:
            super().handle_one_request()
        finally:
            self.gate.arrived(self.connection)

    def log_message(self, fmt: str, *args) -> None:  # one line per request, without bodies
        sys.stderr.write(f"serve-sandbox: {self.address_string()} {fmt % args}\n")

    def _send(self, code: int, obj: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.token is None:
            return True
        got = self.headers.get("Authorization", "")
        ok = got.startswith("Bearer ") and hmac.compare_digest(
            got[7:].strip().encode(), self.token.encode()
        )
        if not ok:
            self._send(401, {"error": "unauthorized"}, {"WWW-Authenticate": "Bearer"})
        return ok

    def _hung_up(self) -> bool:
        """The client closed the connection (a trainer's tool call past its deadline): the
        socket reads as EOF. A pipelined next request reads as data, not as a hang-up."""
        sock = self.connection
        timeout = sock.gettimeout()
        sock.settimeout(0.0)  # a socket with a timeout would wait that long for data first
        try:  # not select(): a busy server's descriptors pass FD_SETSIZE
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:  # nothing to read: still there
            return False
        except OSError:  # reset by the peer
            return True
        finally:
            sock.settimeout(timeout)

    def do_GET(self) -> None:
        self.gate.arrived(self.connection)
        if not self._authorized():
            return
        if self.path != "/health":
            return self._send(404, {"error": f"no such endpoint {self.path}"})
        self._send(200, {"ok": True, **self.sb.info})

    def do_POST(self) -> None:
        self.gate.arrived(self.connection)
        if not self._authorized():
            return
        parser = {"/run": parse_run, "/run_code": parse_run_code}.get(self.path)
        if parser is None:
            return self._send(404, {"error": f"no such endpoint {self.path}"})
        size = self._body_size()
        if size is None:
            return
        request = self._parse_body(parser, size)
        if request is None:
            return
        res = self._execute(*request)
        if res is None:
            return
        if self._hung_up():  # nobody to answer (its job was killed when it was seen)
            self.close_connection = True
            return
        if self.path == "/run":
            self._send(200, dataclasses.asdict(res))
        else:
            self._send(200, to_sandboxfusion(res))

    def _body_size(self) -> int | None:
        """The body's Content-Length, with room for it reserved in the parse budget; None once an
        error was answered (411, 413, 503), the body left unread and the connection closing."""
        length = self.headers.get("Content-Length")
        if length is None or not (length.isascii() and length.isdigit()):  # not '²' (isdigit)
            self.close_connection = True
            self._send(411, {"error": "Content-Length required"})
            return None
        if int(length) > self.srv.max_body_bytes:
            self.close_connection = True  # do not read it
            self._send(413, {"error": f"body over {self.srv.max_body_bytes} bytes"})
            return None
        size = int(length)
        if not self.parsing.acquire(size, timeout=self.srv.head_timeout_s):  # parsed at once
            self.close_connection = True  # its body is not read
            self._send(503, {"error": "server busy parsing"}, {"Retry-After": "1"})
            return None
        return size

    def _parse_body(self, parser: Callable[..., _Request], size: int) -> _Request | None:
        """Read and validate the body (its `size` bytes already reserved, released here):
        `parser`'s (code, stdin, files, limits), or None once a 400 was answered."""
        try:
            raw = self.rfile.read(size)
            body = json.loads(raw)
            del raw
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            return parser(body, self.srv)
        except (ValueError, BadRequest) as e:  # untrusted input: report, never crash
            self._send(400, {"error": str(e)})
        except RecursionError:  # json's parser recurses once per level of nesting
            self._send(400, {"error": "body: JSON nested too deeply"})
        finally:
            self.parsing.release(size)
        return None

    def _execute(
        self, code: str, stdin: bytes, files: dict[str, bytes], limits: Limits
    ) -> ExecResult | None:
        """Run the job if the queue admits it (429 otherwise): its ExecResult, or None once an
        error was answered. The job is killed when the client hangs up."""
        if not self.admitted.acquire(blocking=False):
            self._send(429, {"error": "sandbox queue full"}, {"Retry-After": "1"})
            return None
        try:
            return self.sb.run(code, stdin=stdin, files=files, limits=limits, gave_up=self._hung_up)
        except ValueError as e:  # a bad file name
            self._send(400, {"error": str(e)})
            return None
        finally:
            self.admitted.release()


def make_handler(
    sb: Sandbox, token: str | None, srv: ServerLimits, gate: _Gate | None = None
) -> type[BaseHTTPRequestHandler]:
    """A handler class bound to one server's sandbox, token, limits and waiting-connection gate."""
    bound = {
        "sb": sb,
        "token": token,
        "srv": srv,
        "gate": gate or _Gate(srv.max_waiting, srv.head_timeout_s),
        "admitted": threading.BoundedSemaphore(srv.max_queue),
        "parsing": _ByteBudget(srv.max_parse_bytes),
        "timeout": srv.head_timeout_s,  # each read and write of the socket (the body's included)
    }
    return type("Handler", (_Handler,), bound)


def _read_token(token_file: str | None) -> str | None:
    if token_file:
        with open(token_file) as f:
            tok = f.read().strip()
        if not tok:
            raise SystemExit(f"serve-sandbox: token file {token_file} is empty")
        return tok
    return os.environ.get(TOKEN_ENV) or None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentgrpo serve-sandbox", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (non-loopback needs a token)"
    )
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--token-file", help=f"file holding the bearer token (default: ${TOKEN_ENV})")
    p.add_argument(
        "--backend", default="auto", choices=["auto", "namespaces", "bwrap", "unsafe-local"]
    )
    p.add_argument("--slots", type=int, default=None, help="jobs run at once (default 4 x CPUs)")
    p.add_argument(
        "--max-queue", type=int, default=512, help="requests admitted at once; 429 beyond"
    )
    p.add_argument("--max-body-mb", type=float, default=16.0)
    p.add_argument("--max-wall-s", type=float, default=60.0)
    p.add_argument("--max-memory-mb", type=int, default=4096)
    p.add_argument("--max-output-bytes", type=int, default=8 << 20)
    p.add_argument("--max-processes", type=int, default=256)
    p.add_argument("--max-disk-mb", type=int, default=1024)
    p.add_argument("--max-open-files", type=int, default=1024)
    p.add_argument(
        "--max-parse-mb",
        type=float,
        default=None,
        help="request bodies read and parsed at once (default: --max-body-mb)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=128,
        help="connections not yet past their request head; the oldest is closed beyond",
    )
    p.add_argument(
        "--head-timeout-s",
        type=float,
        default=10.0,
        help="time a connection has to send its request head; and each read and write",
    )
    return p


def make_server(argv: list[str] | None = None) -> tuple[ThreadingHTTPServer, Sandbox]:
    """Parse arguments, check the security rules, start the sandbox and bind (not yet serving)."""
    args = build_parser().parse_args(argv)
    token = _read_token(args.token_file)
    if token is None and not _is_loopback(args.host):
        raise SystemExit(
            f"serve-sandbox: refusing to bind {args.host} without a token: anyone who can reach it "
            f"could run code here. Set {TOKEN_ENV} or pass --token-file."
        )
    try:
        srv = ServerLimits(
            int(args.max_body_mb * (1 << 20)),
            args.max_queue,
            args.max_wall_s,
            args.max_memory_mb,
            args.max_output_bytes,
            args.max_processes,
            args.max_disk_mb,
            args.max_open_files,
            max_parse_bytes=int(args.max_parse_mb * (1 << 20)) if args.max_parse_mb else None,
            max_waiting=args.max_waiting,
            head_timeout_s=args.head_timeout_s,
        )
    except ValueError as e:
        raise SystemExit(f"serve-sandbox: {e}") from None
    sb = Sandbox(backend=args.backend, config=SandboxConfig(slots=args.slots))
    gate = _Gate(srv.max_waiting, srv.head_timeout_s)
    try:
        server = _Server(
            (args.host, args.port), make_handler(sb, token, srv, gate), gate, ipv6=":" in args.host
        )
    except OSError:
        sb.close()
        raise
    return server, sb


def main(argv: list[str] | None = None) -> int:
    try:
        server, sb = make_server(argv)
    except SystemExit as e:  # argparse (already printed) or a refused configuration
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        return int(e.code or 0)
    except (OSError, RuntimeError) as e:
        print(f"serve-sandbox: {e}", file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    print(
        f"serve-sandbox: http://{host}:{port} backend={sb.backend} features={sb.info['features']}",
        file=sys.stderr,
    )
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
