"""Requests per second of `SGLangEngine` in one process, against raw loops in the same run.

The server runs in another process, so what is measured is the client: requests per second at a
fixed concurrency, and this process's CPU time per request (`time.process_time`; the server's is
read from /proc and printed beside it, so a server that is the bottleneck shows). Clients, each
sending the same JSON body and parsing the JSON answer, nothing else:

- raw httpx: one `httpx.AsyncClient` with `concurrency` connections (httpcore scans its pool for
  every queued request, so one big pool is slow);
- httpx, 2-conn pools: the same over pools of 2 connections, the fastest httpx set-up found (what
  the engine used for `/generate` before aiohttp);
- raw aiohttp: one `aiohttp.ClientSession` with `concurrency` keep-alive connections, orjson for
  the bodies (what the engine's `/generate` stands on);
- asyncio streams: keep-alive connections over `asyncio.open_connection`, the floor of an asyncio
  client in Python (no HTTP parsing beyond finding Content-Length);
- SGLangEngine: `generate()` over aiohttp, with balancing, retries bookkeeping and parsing into a
  Completion.

Servers: `--server fake` is `tests/fake_sglang.py` (the protocol in full, a few hundred us of CPU
per request); `--server canned` a stand-in that answers every request with the fake server's
bytes and does nothing else, so that the number is the client's. Rounds are interleaved (each
round runs every client once, in a rotated order) and medians are printed, with each round's
ratio to raw httpx, because on a shared machine single runs swing by 2x.

    python bench/sglang_client.py [--server canned] [--requests 4000] [--concurrency 64]
        [--rounds 3] [--prompt-tokens 200] [--answer-tokens 2] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import orjson  # noqa: E402

from agentgrpo.engine.base import SamplingParams  # noqa: E402
from agentgrpo.engine.sglang.client import SGLangEngine  # noqa: E402
from tests.fake_sglang import FakeSGLangProcess  # noqa: E402

EOS = 151645


def answer_ids(n: int) -> list[int]:
    return [19 + i % 1000 for i in range(n - 1)] + [EOS]


def canned_answer(n: int, prompt_tokens: int) -> bytes:
    """The fake server's answer to the bench's request, as bytes on the wire."""
    ids = answer_ids(n)
    body = json.dumps(
        {
            "text": "x" * n,
            "output_ids": ids,
            "meta_info": {
                "id": "bench",
                "finish_reason": {"type": "stop", "matched": EOS},
                "prompt_tokens": prompt_tokens,
                "weight_version": "default",
                "num_retractions": 0,
                "input_token_logprobs": [],
                "output_token_logprobs": [[-0.055, i, None] for i in ids],
                "output_token_logprobs_length": n,
                "reasoning_tokens": 0,
                "completion_tokens": n,
                "cached_tokens": 0,
                "e2e_latency": 5e-05,
                "response_sent_to_client_ts": 1796439765.0,
            },
        },
        separators=(",", ":"),
    ).encode()
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % len(body)
    ) + body


class _Canned(asyncio.Protocol):
    """Answers each request on the connection with the same bytes once its body has arrived."""

    answer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.buf = transport, bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            i = head.find(b"content-length:")
            n = int(head[i + 15 :].split(b"\r\n", 1)[0]) if i >= 0 else 0
            if len(self.buf) < end + 4 + n:
                return
            del self.buf[: end + 4 + n]
            if head.startswith(b"get"):  # /health_generate, /server_info
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            else:
                self.transport.write(self.answer)


def serve_canned(answer_tokens: int, prompt_tokens: int) -> None:
    _Canned.answer = canned_answer(answer_tokens, prompt_tokens)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Canned, "127.0.0.1", 0, backlog=1024)
        print(f"CANNED_READY http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        await server.serve_forever()

    asyncio.run(main())


class CannedProcess:
    def __init__(self, answer_tokens: int, prompt_tokens: int) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--serve-canned",
                str(answer_tokens),
                "--prompt-tokens",
                str(prompt_tokens),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url = self.proc.stdout.readline().split()[1]

    def __enter__(self) -> CannedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait()


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far; 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run(n: int, concurrency: int, call, server_pid: int) -> tuple[float, float, float]:
    """Run `call()` n times, `concurrency` at a time; returns (wall s, this process's CPU s,
    the server's CPU s)."""
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call()

    wall0, cpu0, srv0 = time.perf_counter(), time.process_time(), cpu_of(server_pid)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - wall0, time.process_time() - cpu0, cpu_of(server_pid) - srv0


async def bench(url: str, server_pid: int, args: argparse.Namespace) -> None:
    n, concurrency = args.requests, args.concurrency
    prompt = [1000 + i % 100000 for i in range(args.prompt_tokens)]
    max_new = args.answer_tokens + 6
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=(EOS,))
    body = {
        "rid": "bench",
        "input_ids": prompt,
        "sampling_params": {
            "max_new_tokens": max_new,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": [EOS],
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    counter = iter(range(10**9))
    host, port = url.rsplit("/", 1)[1].split(":")

    def content() -> bytes:
        body["rid"] = f"raw-{next(counter)}"  # SGLang rejects duplicate in-flight rids
        return json.dumps(body).encode()

    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency))
    pools = [
        httpx.AsyncClient(limits=httpx.Limits(max_connections=2))
        for _ in range(max(1, concurrency // 2))
    ]
    turn = iter(range(10**9))

    async def post(c: httpx.AsyncClient) -> None:
        r = await c.post(
            f"{url}/generate", content=content(), headers={"Content-Type": "application/json"}
        )
        r.raise_for_status()
        json.loads(r.content)

    async def raw() -> None:
        await post(client)

    async def raw_pooled() -> None:
        await post(pools[next(turn) % len(pools)])

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))

    async def raw_aiohttp() -> None:
        body["rid"] = f"raw-{next(counter)}"
        async with session.post(
            f"{url}/generate", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            r.raise_for_status()
            orjson.loads(await r.read())

    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def streams() -> None:
        data = content()
        reader, writer = idle.pop() if idle else await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /generate HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (host.encode(), len(data)) + data
        )
        head = await reader.readuntil(b"\r\n\r\n")
        i = head.lower().find(b"content-length:")
        json.loads(await reader.readexactly(int(head[i + 15 :].split(b"\r\n", 1)[0])))
        idle.append((reader, writer))

    engine = SGLangEngine([url])
    await engine.wait_ready()

    async def engine_call() -> None:
        c = await engine.generate(prompt, params)
        assert c.finish_reason == "stop" and len(c.token_ids) == args.answer_tokens, c

    if args.profile:  # where SGLangEngine's time goes: its calls alone, under cProfile
        await _run(min(500, n), concurrency, engine_call, server_pid)
        prof = cProfile.Profile()
        prof.enable()
        await _run(n, concurrency, engine_call, server_pid)
        prof.disable()
        await asyncio.gather(
            engine.aclose(), client.aclose(), session.close(), *(p.aclose() for p in pools)
        )
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    calls = {
        "raw httpx": raw,
        "httpx, 2-conn pools": raw_pooled,
        "raw aiohttp": raw_aiohttp,
        "asyncio streams": streams,
        "SGLangEngine": engine_call,
    }
    for call in calls.values():  # warm up connections and code paths
        await _run(min(500, n), concurrency, call, server_pid)
    rounds: dict[str, list[tuple[float, float, float]]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rounds[name].append(await _run(n, concurrency, calls[name], server_pid))
    await engine.aclose()
    await asyncio.gather(client.aclose(), session.close(), *(p.aclose() for p in pools))
    for w in idle:
        w[1].close()
    print(
        f"{n} requests x {args.rounds} interleaved rounds, concurrency {concurrency}, "
        f"{args.prompt_tokens}-token prompts, {args.answer_tokens}-token answers, "
        f"{args.server} server in another process, {os.cpu_count()} CPUs; medians, [min-max] "
        "over rounds"
    )
    base = rounds["raw httpx"]
    for name, rs in rounds.items():
        rate = [n / w for w, _, _ in rs]
        cpu = [1e6 * c / n for _, c, _ in rs]
        srv = [1e6 * s / n for _, _, s in rs]
        ratio = [b[0] / w for b, (w, _, _) in zip(base, rs, strict=True)]
        print(
            f"  {name:20s} {statistics.median(rate):6.0f} req/s [{min(rate):.0f}-{max(rate):.0f}]"
            f"  client {statistics.median(cpu):5.0f} us CPU/req [{min(cpu):.0f}-{max(cpu):.0f}]"
            f"  server {statistics.median(srv):4.0f} us CPU/req"
            f"  vs raw httpx {statistics.median(ratio):.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=["fake", "canned"], default="fake")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--answer-tokens", type=int, default=2)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="profile SGLangEngine's requests (cProfile) instead of comparing clients",
    )
    ap.add_argument("--serve-canned", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_canned is not None:
        serve_canned(args.serve_canned, args.prompt_tokens)
        return
    if args.server == "canned":
        server = CannedProcess(args.answer_tokens, args.prompt_tokens)
    else:
        ids = ",".join(map(str, answer_ids(args.answer_tokens)))
        server = FakeSGLangProcess("--output", ids)
    with server:
        asyncio.run(bench(server.url, server.proc.pid, args))


if __name__ == "__main__":
    main()
