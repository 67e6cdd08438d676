"""`serve-sandbox`: auth, bounds, back-pressure, the native and the SandboxFusion-compatible API,
and `Sandbox(url=...)` against it. The server runs in a thread of this process on a free port.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import pytest

from agentgrpo.verify import sandbox_server
from agentgrpo.verify.sandbox import Limits, Sandbox, SandboxConfig

TOKEN = "s3cret-token-for-tests"


def _serve(argv: list[str], env_token: str | None = None):
    old = os.environ.pop(sandbox_server.TOKEN_ENV, None)
    if env_token:
        os.environ[sandbox_server.TOKEN_ENV] = env_token
    try:
        backend = "namespaces" if os.geteuid() == 0 else "auto"
        server, sb = sandbox_server.make_server(
            ["--port", "0", "--backend", backend, "--slots", "2", *argv]
        )
    except RuntimeError as e:
        pytest.skip(f"no sandbox backend on this host: {e}")
    finally:
        os.environ.pop(sandbox_server.TOKEN_ENV, None)
        if old is not None:
            os.environ[sandbox_server.TOKEN_ENV] = old
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    host, port = server.server_address[:2]
    return f"http://{host}:{port}", server, sb


@pytest.fixture(scope="module")
def open_server():
    url, server, sb = _serve(["--max-queue", "1", "--max-body-mb", "0.01", "--max-wall-s", "2"])
    yield url
    server.shutdown()
    server.server_close()
    sb.close()


@pytest.fixture(scope="module")
def token_server():
    url, server, sb = _serve([], env_token=TOKEN)
    yield url
    server.shutdown()
    server.server_close()
    sb.close()


def test_health_and_run(open_server):
    r = httpx.get(open_server + "/health")
    assert r.status_code == 200 and r.json()["ok"] is True and r.json()["features"]
    r = httpx.post(
        open_server + "/run",
        json={
            "code": "print(input() * 2)",
            "stdin": "ab",
            "files": {"a.txt": "x"},
            "limits": {"wall_s": 1},
        },
    )
    d = r.json()
    assert r.status_code == 200 and (d["status"], d["stdout"], d["exit_code"]) == (
        "ok",
        "abab\n",
        0,
    )


def test_client_against_server(open_server):
    sb = Sandbox(url=open_server)
    try:
        res = sb.run(
            "import sys; print(open('f.bin','rb').read()); sys.exit(4)",
            files={"f.bin": b"\x00\x01"},
        )
        assert (res.status, res.exit_code, res.stdout) == ("runtime_error", 4, "b'\\x00\\x01'\n")
        assert res.backend.startswith("remote:")
        res = asyncio.run(sb.arun("print('async')"))
        assert (res.status, res.stdout) == ("ok", "async\n")
    finally:
        sb.close()


def test_limits_are_clamped_to_server_maxima(open_server):
    # the server's --max-wall-s 2 wins over a request for 1000 s
    r = httpx.post(
        open_server + "/run",
        json={"code": "import time; time.sleep(30)", "limits": {"wall_s": 1000}},
        timeout=20,
    )
    d = r.json()
    assert d["status"] == "timeout" and 2.0 <= d["wall_s"] < 6.0


def test_bad_requests(open_server):
    assert httpx.post(open_server + "/run", json={"nocode": 1}).status_code == 400
    assert (
        httpx.post(open_server + "/run", json={"code": "1", "limits": {"wall_s": -1}}).status_code
        == 400
    )
    assert (
        httpx.post(open_server + "/run", json={"code": "1", "stdin_b64": "%%%"}).status_code == 400
    )
    assert (
        httpx.post(open_server + "/run", json={"code": "1", "files": {"../x": "y"}}).status_code
        == 400
    )
    assert (
        httpx.post(
            open_server + "/run", content=b"[1]", headers={"Content-Type": "application/json"}
        ).status_code
        == 400
    )
    assert httpx.post(open_server + "/nope", json={}).status_code == 404
    big = {"code": "x" * 20000}  # over --max-body-mb 0.01
    assert httpx.post(open_server + "/run", json=big).status_code == 413


MALFORMED = [  # (body, the field its 400 must name): each once dropped the connection (issue 33)
    ({"code": "1", "files": ["a.txt"]}, "'files'"),
    ({"code": "1", "files": "a.txt"}, "'files'"),
    ({"code": "1", "files": {"a.txt": 5}}, "'files['a.txt']'"),
    ({"code": "1", "files_b64": ["eA=="]}, "'files_b64'"),
    ({"code": "1", "files_b64": "eA=="}, "'files_b64'"),
    ({"code": "1", "files_b64": {"a": 5}}, "'files_b64['a']'"),
    ({"code": "1", "limits": "fast"}, "'limits'"),
    ({"code": "1", "limits": [1]}, "'limits'"),
    ({"code": "1", "limits": {"wall_s": "soon"}}, "'limits.wall_s'"),
    ({"code": "1", "stdin": ["x"]}, "'stdin'"),
    ({"code": "1", "stdin_b64": 5}, "'stdin_b64'"),
]
MALFORMED_RUN_CODE = [
    ({"code": "1", "run_timeout": [1]}, "'run_timeout'"),
    ({"code": "1", "run_timeout": {"s": 1}}, "'run_timeout'"),
    ({"code": "1", "memory_limit_MB": "lots"}, "'memory_limit_MB'"),
    ({"code": "1", "files": ["a"]}, "'files'"),
    ({"code": "1", "files": "a"}, "'files'"),
]


def _raw_post(url: str, head: bytes, body: bytes) -> bytes:
    """One request over a plain socket (httpx would not send a malformed header), its response."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body)
        s.shutdown(socket.SHUT_WR) if not body else None
        return s.recv(65536)


def test_malformed_request_shapes_each_get_a_400_naming_the_field(open_server):
    for path, cases in (("/run", MALFORMED), ("/run_code", MALFORMED_RUN_CODE)):
        for body, field in cases:
            r = httpx.post(open_server + path, json=body, timeout=10)
            assert r.status_code == 400 and field in r.json()["error"], (path, body, r.text)
    deep = b"[" * 5000 + b"]" * 5000  # json recurses per level: RecursionError, not a 400, before
    r = httpx.post(open_server + "/run", content=deep, timeout=10)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]
    # '\u00b2' (superscript two) is a digit to str.isdigit() and not to int()
    head = "POST /run HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\n".encode()
    assert _raw_post(open_server, head, b"").startswith(b"HTTP/1.1 411")
    assert httpx.get(open_server + "/health").status_code == 200  # still serving


@pytest.fixture(scope="module")
def small_server():
    url, server, sb = _serve(
        [
            "--max-wall-s",
            "3",
            "--max-memory-mb",
            "512",
            "--max-processes",
            "32",
            "--max-disk-mb",
            "8",
            "--max-open-files",
            "64",
        ]
    )
    yield url
    server.shutdown()
    server.server_close()
    sb.close()


def test_every_limit_is_clamped_even_above_the_hard_maximum(small_server):
    """processes, disk_mb and open_files are clamped to the server's maxima like wall time and
    memory; a request above `Limits`' own hard maximum is clamped too, not refused (issue 33)."""
    code = (
        "import resource as r\n"
        "print(*(r.getrlimit(x)[0] for x in (r.RLIMIT_NPROC, r.RLIMIT_FSIZE, r.RLIMIT_NOFILE)))"
    )
    asked = {
        "processes": 4096,
        "disk_mb": 1 << 20,
        "open_files": 65536,
        "wall_s": 1e6,
        "memory_mb": 1 << 30,
        "output_bytes": 1 << 40,
    }  # all but processes over Limits' bound
    r = httpx.post(small_server + "/run", json={"code": code, "limits": asked}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["stdout"].split() == ["32", str(8 << 20), "64"]
    r = httpx.post(
        small_server + "/run_code",
        json={"code": "print(1)", "run_timeout": 1e9, "memory_limit_MB": 1e12},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["status"] == "Success", r.text
    assert (
        httpx.post(
            small_server + "/run", json={"code": "1", "limits": {"processes": 0}}
        ).status_code
        == 400
    )  # below the minimum is nonsense, not clamped
    with pytest.raises(SystemExit, match="server maximum processes"):
        sandbox_server.make_server(["--port", "0", "--max-processes", "100000"])


def test_queue_full_gives_429(open_server):
    # --max-queue 1: while one slow job runs, a second request is turned away with Retry-After
    slow = threading.Thread(
        target=lambda: httpx.post(
            open_server + "/run",
            json={"code": "import time; time.sleep(1.2)", "limits": {"wall_s": 2}},
            timeout=10,
        )
    )
    slow.start()
    time.sleep(0.4)  # the slow job is admitted and running
    try:
        r = httpx.post(open_server + "/run", json={"code": "print(1)"})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    finally:
        slow.join()


def test_client_retries_busy_server(open_server):
    # the client treats 429 as back-pressure: it waits and retries instead of failing the job
    slow = threading.Thread(
        target=lambda: httpx.post(
            open_server + "/run",
            json={"code": "import time; time.sleep(1.0)", "limits": {"wall_s": 2}},
            timeout=10,
        )
    )
    slow.start()
    time.sleep(0.4)
    try:
        sb = Sandbox(url=open_server, config=SandboxConfig(busy_wait_s=10))
        t0 = time.monotonic()
        res = sb.run("print('eventually')", limits=Limits(wall_s=1))
        assert (res.status, res.stdout) == ("ok", "eventually\n")
        assert time.monotonic() - t0 > 0.3  # it did wait for the slow job to leave
        sb.close()
    finally:
        slow.join()


def test_waiting_for_a_busy_server_is_not_charged_to_a_tool_deadline(open_server):
    import asyncio

    from agentgrpo import Message, Task, ToolCall, ToolEnv, tool
    from tools.python import make_python_tool

    sb = Sandbox(url=open_server, config=SandboxConfig(busy_wait_s=10))

    class PyEnv(ToolEnv):
        tool_timeout_s = 0.5  # the server is busy for about 1 s: the retries wait past it
        tools = (tool(make_python_tool(sb)),)

        def reward(self, task, messages):
            return 1.0

    slow = threading.Thread(
        target=lambda: httpx.post(
            open_server + "/run",
            json={"code": "import time; time.sleep(1.2)", "limits": {"wall_s": 2}},
            timeout=10,
        )
    )
    slow.start()
    time.sleep(0.3)
    try:
        env = PyEnv()
        env.reset(options={"task": Task(id="t", prompt="p")})
        call = ToolCall(id="1", name="python", arguments={"code": "print(2+2)"})
        step = asyncio.run(env.step(Message(role="assistant", content="", tool_calls=[call])))
        out = step.messages
        assert not step.tool_errors and "status: ok" in out[0].content, out[0].content
    finally:
        slow.join()
        sb.close()


def test_sandboxfusion_run_code(open_server):
    r = httpx.post(
        open_server + "/run_code",
        json={
            "code": "print(open('in.txt').read())",
            "language": "python",
            "run_timeout": 1,
            "files": {"in.txt": "aGk="},
        },
    )
    d = r.json()
    assert (
        d["status"],
        d["run_result"]["status"],
        d["run_result"]["stdout"],
        d["run_result"]["return_code"],
    ) == ("Success", "Finished", "hi\n", 0)
    d = httpx.post(
        open_server + "/run_code", json={"code": "import time; time.sleep(5)", "run_timeout": 0.3}
    ).json()
    assert (d["status"], d["run_result"]["status"]) == ("Failed", "TimeLimitExceeded")
    d = httpx.post(
        open_server + "/run_code", json={"code": "raise SystemExit(2)", "language": "python"}
    ).json()
    assert (d["status"], d["run_result"]["return_code"]) == ("Failed", 2)
    assert (
        httpx.post(open_server + "/run_code", json={"code": "x", "language": "cpp"}).status_code
        == 400
    )


def _verl_request(code: str, stdin: str = "", timeout: float = 2) -> dict:
    """The body verl's SandboxFusion client posts (`call_sandbox_api` in
    verl/utils/reward_score/sandbox_fusion/utils.py)."""
    return {
        "compile_timeout": timeout,
        "run_timeout": timeout,
        "code": code,
        "stdin": stdin,
        "language": "python",
        "files": {},
        "fetch_files": [],
    }


def _verl_verdict(answer: dict, expected: str) -> bool | int:
    """How verl's `check_correctness` reads one answer: True / False (the output compared, trailing
    newlines aside), -1 sandbox error, -2 runtime error, -3 time limit (restated from verl)."""
    run = answer.get("run_result") or {}
    if answer["status"] == "Success" and run.get("status") == "Finished":
        return (run.get("stdout") or "").rstrip("\n") == expected.rstrip("\n")
    if answer["status"] == "Failed" and run.get("status") == "TimeLimitExceeded":
        return -3
    if answer["status"] == "Failed" and (
        run.get("status") == "Error"
        or (run.get("status") == "Finished" and run.get("return_code") != 0)
    ):
        return -2
    return -1


def test_run_code_gives_sandboxfusion_verdicts_on_verl_requests(open_server):
    """verl's request shape; large output, killed processes and timeouts answered as
    SandboxFusion answers them (issue 29, item 6)."""

    def post(code, stdin="", timeout=2):
        r = httpx.post(
            open_server + "/run_code",
            json=_verl_request(code, stdin, timeout),
            headers={"Accept": "application/json"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()

    ok = post("print(int(input()) * 2)", "21")
    assert _verl_verdict(ok, "42") is True and ok["run_result"]["return_code"] == 0
    # output past SandboxFusion's 1 MiB capture is cut, not a failed run: the answer printed
    # first still counts, as it would on SandboxFusion (before: Failed, a runtime error to verl)
    big_err = post("import sys\nprint(int(input()) * 2)\nsys.stderr.write('e' * (3 << 20))", "21")
    assert (big_err["status"], big_err["run_result"]["return_code"]) == ("Success", 0)
    assert big_err["run_result"]["stderr"] == "e" * (1 << 20)
    assert _verl_verdict(big_err, "42") is True
    big_out = post("print('x' * (2 << 20))")
    assert big_out["status"] == "Success" and big_out["run_result"]["stdout"] == "x" * (1 << 20)
    assert _verl_verdict(big_out, "x" * (2 << 20)) is False  # a wrong answer, not an error
    # a process a signal ended: the negative signal, as Python's returncode (SandboxFusion)
    for sig in (9, 15):
        killed = post(f"import os\nprint('partial', flush=True)\nos.kill(os.getpid(), {sig})")
        run = killed["run_result"]
        assert (killed["status"], run["status"], run["return_code"]) == ("Failed", "Finished", -sig)
        assert run["stdout"] == "partial\n" and _verl_verdict(killed, "partial") == -2
    # a timeout: TimeLimitExceeded with return_code null, the output so far kept
    slow = post("print('started', flush=True)\nwhile True: pass", timeout=0.5)
    run = slow["run_result"]
    assert (slow["status"], run["status"]) == ("Failed", "TimeLimitExceeded")
    assert run["return_code"] is None
    assert run["stdout"] == "started\n" and _verl_verdict(slow, "started") == -3
    exited = post("raise SystemExit(3)")
    assert exited["run_result"]["return_code"] == 3 and _verl_verdict(exited, "") == -2
    # the difference that stays (docs/sandbox.md): past the server's --max-output-bytes (8 MiB)
    # the job is killed, a runtime error to verl; SandboxFusion would let it run on
    flood = post("import sys\nsys.stdout.write('y' * (9 << 20))")
    run = flood["run_result"]
    assert (flood["status"], run["status"], run["return_code"]) == ("Failed", "Finished", -9)
    assert "output" in flood["message"] and len(run["stdout"]) == 1 << 20
    # asking for files back is refused by name rather than answered with none
    r = httpx.post(open_server + "/run_code", json={**_verl_request("1"), "fetch_files": ["a.txt"]})
    assert r.status_code == 400 and "fetch_files" in r.json()["error"]


def test_token_required_when_configured(token_server):
    assert httpx.get(token_server + "/health").status_code == 401
    r = httpx.post(
        token_server + "/run", json={"code": "print(1)"}, headers={"Authorization": "Bearer wrong"}
    )
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    ok = httpx.post(
        token_server + "/run",
        json={"code": "print(1)"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert ok.status_code == 200 and ok.json()["stdout"] == "1\n"
    sb = Sandbox(url=token_server, token=TOKEN)
    try:
        assert sb.run("print(2)").stdout == "2\n"
    finally:
        sb.close()
    bad = Sandbox(url=token_server, token="nope", config=SandboxConfig(retries=0))
    try:
        res = bad.run("print(3)")
        assert res.status == "sandbox_error" and "401" in res.detail
    finally:
        bad.close()


def test_non_loopback_bind_needs_token(capsys, monkeypatch):
    monkeypatch.delenv(sandbox_server.TOKEN_ENV, raising=False)
    assert sandbox_server.main(["--host", "0.0.0.0", "--port", "0"]) == 2
    assert "refusing to bind 0.0.0.0 without a token" in capsys.readouterr().err


def test_token_file(tmp_path, monkeypatch):
    monkeypatch.delenv(sandbox_server.TOKEN_ENV, raising=False)
    f = tmp_path / "tok"
    f.write_text(TOKEN + "\n")
    url, server, sb = _serve(["--token-file", str(f)])
    try:
        assert httpx.get(url + "/health").status_code == 401
        assert (
            httpx.get(url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}).status_code
            == 200
        )
    finally:
        server.shutdown()
        server.server_close()
        sb.close()


def test_a_client_that_hangs_up_has_its_job_killed():
    # One slot: a trainer's tool call past its deadline cancels `arun`, which closes the
    # connection; the server sees it and kills the job, so the next call gets the slot at once
    # instead of after the 30 s the first one asked for.
    url, server, sb = _serve(["--slots", "1"])
    box = Sandbox(url=url, config=SandboxConfig(retries=0))
    try:

        async def give_up():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(
                    box.arun("import time; time.sleep(30)", limits=Limits(wall_s=30)), 1.5
                )

        asyncio.run(give_up())
        t0 = time.monotonic()
        res = box.run("print('next')", limits=Limits(wall_s=5))
        assert (res.status, res.stdout) == ("ok", "next\n")
        assert time.monotonic() - t0 < 10
    finally:
        box.close()
        server.shutdown()
        server.server_close()
        sb.close()


def test_a_server_with_over_a_thousand_descriptors_open_still_answers():
    # The hang-up check must not use select(), which refuses descriptors past FD_SETSIZE (1024):
    # a busy server with many keep-alive connections gets there.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below 1300")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    url, server, sb = _serve([])
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]  # other connections
    try:
        for code in ("print('fast')", "import time; time.sleep(0.5); print('slow')"):
            r = httpx.post(url + "/run", json={"code": code}, timeout=30)
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        server.shutdown()
        server.server_close()
        sb.close()


# --- idle, slow and large requests cannot tie the server up (issue 33, findings 2 and 3) --------


def test_idle_and_slow_connections_cannot_tie_up_the_server():
    """300 idle connections and a client dripping its request head a byte at a time: the server
    keeps at most --max-waiting of them (a thread each), shuts the drip at --head-timeout-s in
    all (not per byte), and an authorised request made after them answers within a second."""
    import socket

    url, server, sb = _serve(["--max-waiting", "32", "--head-timeout-s", "2"], env_token=TOKEN)
    host, port = server.server_address[:2]
    threads_before = threading.active_count()
    idle = []
    stop = threading.Event()
    dripped = {"closed_after": None}

    def drip():
        with socket.create_connection((host, port)) as s:
            start = time.monotonic()
            try:
                for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 1000:
                    if stop.is_set():
                        return
                    s.sendall(bytes([byte]))
                    time.sleep(0.1)
            except OSError:  # shut by the server
                dripped["closed_after"] = time.monotonic() - start

    try:
        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        for _ in range(300):
            idle.append(socket.create_connection((host, port)))
        time.sleep(0.5)
        start = time.monotonic()
        r = httpx.get(url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        assert r.status_code == 200 and time.monotonic() - start < 1.0
        assert threading.active_count() - threads_before < 32 + 10  # not one thread per connection
        dripper.join(timeout=10)
        assert dripped["closed_after"] is not None and dripped["closed_after"] < 2 + 1.5
    finally:
        stop.set()
        for s in idle:
            s.close()
        server.shutdown()
        server.server_close()
        sb.close()


def test_request_bodies_parsed_at_once_are_bounded(monkeypatch):
    """One 15 MB JSON body once took 392 MB to parse, three at once 1.5 GB: the bodies being read
    and parsed at once hold at most --max-parse-mb (default: one body of --max-body-mb); the
    others wait their turn and are answered."""
    import json as real_json
    import types

    inside, most = [0], [0]
    lock = threading.Lock()

    def loads(raw):
        with lock:
            inside[0] += len(raw)
            most[0] = max(most[0], inside[0])
        time.sleep(0.3)  # long enough for the other requests to arrive meanwhile
        try:
            return real_json.loads(raw)
        finally:
            with lock:
                inside[0] -= len(raw)

    monkeypatch.setattr(
        sandbox_server, "json", types.SimpleNamespace(loads=loads, dumps=real_json.dumps)
    )
    url, server, sb = _serve(["--max-body-mb", "8"])
    body = {"code": "print(1)", "pad": "x" * (6 << 20)}

    def post(_):
        return httpx.post(url + "/run", json=body, timeout=60)

    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(post, range(3)))
        assert [r.status_code for r in answers] == [200] * 3
        assert 6 << 20 < most[0] <= 8 << 20  # one 6 MB body at a time under 8 MB
    finally:
        server.shutdown()
        server.server_close()
        sb.close()


# --- the client trusts no server (issue 33, finding 5) ------------------------------------------

GOOD = {
    "status": "ok",
    "exit_code": 0,
    "signal": None,
    "stdout": "",
    "stderr": "",
    "truncated": False,
    "wall_s": 0.1,
    "backend": "namespaces",
}
HOSTILE = {  # what a broken or hostile server answers: (status, headers, body or a callable)
    "a JSON list": (200, {}, b"[1, 2]"),
    "an unknown status": (200, {}, {**GOOD, "status": "pwned"}),
    "a number as stdout": (200, {}, {**GOOD, "stdout": 5}),
    "a string as exit_code": (200, {}, {**GOOD, "exit_code": "0"}),
    "NaN as wall_s": (
        200,
        {},
        b'{"status": "ok", "exit_code": 0, "signal": null, "stdout": "", '
        b'"stderr": "", "truncated": false, "wall_s": NaN, "backend": "x"}',
    ),
    "a missing field": (200, {}, {"status": "ok"}),
    "not JSON": (200, {}, b"<html>"),
    "Retry-After: nan": (429, {"Retry-After": "nan"}, b"{}"),
    "a huge body": (200, {}, b" " * (1 << 20)),
    "a slow drip": (200, {}, "drip"),
}


@pytest.fixture(scope="module")
def hostile_server():
    """An HTTP server answering /run as `HostileHandler.answer` says."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class HostileHandler(BaseHTTPRequestHandler):
        answer = HOSTILE["a JSON list"]

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            code, headers, body = type(self).answer
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            if body == "drip":  # one byte every 0.2 s of a long body: each read is quick
                self.send_header("Content-Length", "100000")
                self.end_headers()
                try:
                    for _ in range(100000):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:
                    return
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), HostileHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", HostileHandler
    server.shutdown()
    server.server_close()


def test_every_hostile_answer_is_a_sandbox_error_within_the_calls_bound(
    hostile_server, monkeypatch
):
    from agentgrpo.verify import _remote_client

    url, handler = hostile_server
    monkeypatch.setattr(_remote_client, "SERVER_QUEUE_S", 0.0)  # bound: wall_s 1 + margin 0.5
    sb = Sandbox(url=url, config=SandboxConfig(retries=0, margin_s=0.5, busy_wait_s=0.3))
    limits = Limits(wall_s=1, output_bytes=1000)
    try:
        handler.answer = (200, {}, GOOD)  # the client reads a good answer as it is
        assert (
            sb.run("1", limits=limits).stdout == "" and sb.run("1").backend == "remote:namespaces"
        )
        for name, answer in HOSTILE.items():
            handler.answer = answer
            for call in (
                lambda: sb.run("1", limits=limits),
                lambda: asyncio.run(sb.arun("1", limits=limits)),
            ):
                start = time.monotonic()
                res = call()
                took = time.monotonic() - start
                assert res.status == "sandbox_error" and res.exit_code is None, (name, res)
                assert took < 2.5, (name, took)
    finally:
        sb.close()
