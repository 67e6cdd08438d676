"""The requests and answers of `serve-sandbox` (`sandbox_server.py`): a /run or /run_code body
validated into the arguments of `Sandbox.run`, every limit clamped to the server's maxima, and an
`ExecResult` in SandboxFusion's answer shape. No HTTP here; `sandbox_server.py` re-exports it.
"""

from __future__ import annotations

import base64
import binascii
import signal
import socket

from pydantic import ValidationError

from agentgrpo.verify._records import Limits


class ServerLimits:
    """The most a request may ask for; requests asking for more are clamped, not refused.

    Every resource a job has is clamped (wall time, memory, processes, /tmp size, open files,
    output), and a request above `Limits`' own hard maximum is clamped too (it is a number over
    the server's maximum like any other). Only nonsense (a negative time, a string) is a 400.
    """

    def __init__(
        self,
        max_body_bytes: int,
        max_queue: int,
        max_wall_s: float,
        max_memory_mb: int,
        max_output_bytes: int,
        max_processes: int = 256,
        max_disk_mb: int = 1024,
        max_open_files: int = 1024,
        *,
        max_parse_bytes: int | None = None,
        max_waiting: int = 128,
        head_timeout_s: float = 10.0,
    ) -> None:
        self.max_body_bytes, self.max_queue = max_body_bytes, max_queue
        # Bytes of request bodies read and parsed at once (json.loads of a body can take ~25x its
        # size); by default one body of the largest size, or several smaller ones.
        self.max_parse_bytes = max_parse_bytes or max_body_bytes
        if self.max_parse_bytes < max_body_bytes:
            raise ValueError(
                f"--max-parse-mb must hold one body of --max-body-mb ({max_body_bytes} bytes)"
            )
        self.max_waiting, self.head_timeout_s = max_waiting, head_timeout_s
        try:  # the maxima must themselves be limits a job may have
            self.maxima = Limits(
                wall_s=max_wall_s,
                memory_mb=max_memory_mb,
                output_bytes=max_output_bytes,
                processes=max_processes,
                disk_mb=max_disk_mb,
                open_files=max_open_files,
            ).model_dump()
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"server maximum {err['loc'][0]}: {err['msg']}") from None

    def limits(self, raw: object, field: str = "limits") -> Limits:
        """`raw` (a request's JSON) as Limits, each number above the server's maximum lowered to
        it; BadRequest naming the field for anything else that is not a valid limit."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise BadRequest(f"'{field}' must be a JSON object, not {_json_type(raw)}")
        clamped = {
            k: self.maxima[k] if k in self.maxima and _number(v) and v > self.maxima[k] else v
            for k, v in raw.items()
        }
        try:
            return Limits(**clamped)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise BadRequest(f"'{field}.{where}': {err['msg']}") from None


class BadRequest(Exception):
    """A malformed request (400); the message goes back to the client."""


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    names |= {int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(body: dict, field: str) -> str | None:
    value = body.get(field)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{field}' must be a string, not {_json_type(value)}")
    return value


def _b64(s: object, what: str) -> bytes:
    if not isinstance(s, str):
        raise BadRequest(f"'{what}' must be a base64 string, not {_json_type(s)}")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"'{what}' is not valid base64") from None


def _files(body: dict, field: str, *, b64: bool) -> dict[str, bytes]:
    """The {name: content} object `body[field]` (text, or base64 when `b64`); {} when absent."""
    value = body.get(field)
    if value is None:
        return {}
    if not isinstance(value, dict):
        got = _json_type(value)
        raise BadRequest(f"'{field}' must be a JSON object {{name: content}}, not {got}")
    files = {}
    for name, content in value.items():
        if b64:
            files[name] = _b64(content, f"{field}[{name!r}]")
        elif isinstance(content, str):
            files[name] = content.encode()
        else:
            raise BadRequest(f"'{field}[{name!r}]' must be a string, not {_json_type(content)}")
    return files


def parse_run(body: dict, srv: ServerLimits) -> tuple[str, bytes, dict[str, bytes], Limits]:
    """Validate a /run body into arguments of `Sandbox.run`."""
    if not isinstance(body.get("code"), str):
        raise BadRequest("'code' (a string) is required")
    if "stdin_b64" in body:
        stdin = _b64(body["stdin_b64"], "stdin_b64")
    else:
        stdin = (_text(body, "stdin") or "").encode()
    files = _files(body, "files", b64=False)
    files.update(_files(body, "files_b64", b64=True))
    return body["code"], stdin, files, srv.limits(body.get("limits"))


SANDBOXFUSION_OUTPUT_BYTES = 1 << 20
"""What SandboxFusion keeps of stdout and of stderr each (its runner drains the rest and drops it;
the program runs on). `/run_code` cuts its answers to this, whatever the server's own cap."""


def parse_run_code(body: dict, srv: ServerLimits) -> tuple[str, bytes, dict[str, bytes], Limits]:
    """Validate a SandboxFusion /run_code body (python only).

    The job may write up to the server's `--max-output-bytes` (never more: no field of the body
    sets it) so that output past SandboxFusion's 1 MiB, which SandboxFusion drops while the
    program goes on, does not end the job here either; `to_sandboxfusion` cuts it to 1 MiB."""
    lang = body.get("language", "python")
    if lang not in ("python", "python3"):
        raise BadRequest(f"language {lang!r} is not supported here (python only)")
    if not isinstance(body.get("code"), str):
        raise BadRequest("'code' (a string) is required")
    if body.get("fetch_files"):  # verl sends []; an answer without them would read as "not found"
        raise BadRequest("'fetch_files' is not supported here: send [] or leave it out")
    timeout, mem = body.get("run_timeout", 10), body.get("memory_limit_MB", -1)
    for field, value in (("run_timeout", timeout), ("memory_limit_MB", mem)):
        if value is not None and not _number(value):
            raise BadRequest(f"'{field}' must be a number, not {_json_type(value)}")
    lim = {"wall_s": timeout or 10, "output_bytes": srv.maxima["output_bytes"]}
    if mem is not None and mem > 0:
        lim["memory_mb"] = int(min(mem, srv.maxima["memory_mb"]))
    files = body.get("files")
    if isinstance(files, dict):  # SandboxFusion sends null for a file it does not want
        body = {**body, "files": {k: v for k, v in files.items() if v is not None}}
    return (
        body["code"],
        (_text(body, "stdin") or "").encode(),
        _files(body, "files", b64=True),
        srv.limits(lim, "run_timeout/memory_limit_MB"),
    )


def to_sandboxfusion(res) -> dict:
    """An ExecResult in SandboxFusion's RunCodeResponse shape, with the values SandboxFusion
    gives (what verl's `check_correctness` reads): a timeout is `TimeLimitExceeded` with
    `return_code` null; a process a signal ended has the negative signal (Python's `returncode`
    of a killed child; -9 for SIGKILL); stdout and stderr are cut to
    `SANDBOXFUSION_OUTPUT_BYTES` of UTF-8 (a character split at the cut is dropped). `message`
    names the cause of a `Failed` run; SandboxFusion leaves it empty, and verl does not read it.
    """
    if res.status == "sandbox_error":
        return {
            "status": "SandboxError",
            "message": res.detail,
            "compile_result": None,
            "run_result": None,
            "executor_pod_name": socket.gethostname(),
            "files": {},
        }
    timed_out = res.status == "timeout"
    if timed_out:
        rc = None
    elif res.signal:
        rc = -res.signal
    elif res.exit_code is None and res.status == "output_limit":
        rc = -signal.SIGKILL  # past --max-output-bytes the sandbox kills the job (its init)
    else:
        rc = res.exit_code
    return {
        "status": "Success" if res.status == "ok" else "Failed",
        "message": "" if res.status == "ok" else f"{res.status}: {res.detail}".rstrip(": "),
        "compile_result": None,
        "run_result": {
            "status": "TimeLimitExceeded" if timed_out else "Finished",
            "execution_time": res.wall_s,
            "return_code": rc,
            "stdout": _cut(res.stdout),
            "stderr": _cut(res.stderr),
        },
        "executor_pod_name": socket.gethostname(),
        "files": {},
    }


def _cut(text: str) -> str:
    raw = text.encode()
    if len(raw) <= SANDBOXFUSION_OUTPUT_BYTES:
        return text
    return raw[:SANDBOXFUSION_OUTPUT_BYTES].decode(errors="ignore")
