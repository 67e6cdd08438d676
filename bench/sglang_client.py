"""Client overhead of `SGLangEngine` per request, against a raw httpx loop in the same run.

The fake SGLang server (`tests/fake_sglang.py`) runs in another process and answers instantly, so
what is measured is the client: requests per second at a fixed concurrency, and this process's CPU
time per request (`time.process_time`, which excludes the server process). The baseline posts the
same JSON body with a bare `httpx.AsyncClient` and parses the JSON answer, nothing else; a second
baseline does the same over 8-connection pools, as the engine does (httpcore's single pool costs
O(connections x waiting requests) per request), so the difference to it is the engine's own work:
request building, balancing, retries bookkeeping, parsing into a Completion.

    python bench/sglang_client.py [--requests 4000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from agentgrpo.engine.base import SamplingParams  # noqa: E402
from agentgrpo.engine.sglang import SGLangEngine  # noqa: E402
from tests.fake_sglang import FakeSGLangProcess  # noqa: E402

PROMPT = list(range(1000, 1200))  # a 200-token prompt
PARAMS = SamplingParams(max_new_tokens=8, stop_token_ids=(151645,))


async def _run(n: int, concurrency: int, call) -> tuple[float, float]:
    """Run `call()` n times, `concurrency` at a time; returns (wall s, this process's CPU s)."""
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call()

    wall0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - wall0, time.process_time() - cpu0


async def bench(url: str, n: int, concurrency: int) -> None:
    body = {
        "rid": "bench", "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                            "stop_token_ids": [151645], "skip_special_tokens": False,
                            "spaces_between_special_tokens": False, "no_stop_trim": True},
        "return_logprob": True, "logprob_start_len": -1, "stream": False,
    }
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        pools = [httpx.AsyncClient(limits=httpx.Limits(max_connections=8))
                 for _ in range(max(1, concurrency // 8))]

        async def post(c: httpx.AsyncClient) -> None:
            body["rid"] = f"raw-{next(counter)}"  # SGLang rejects duplicate in-flight rids
            r = await c.post(f"{url}/generate", content=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
            r.raise_for_status()
            json.loads(r.content)

        async def raw() -> None:
            await post(client)

        turn = iter(range(10**9))

        async def raw_pooled() -> None:
            await post(pools[next(turn) % len(pools)])

        engine = SGLangEngine([url])
        await engine.wait_ready()

        async def client_call() -> None:
            c = await engine.generate(PROMPT, PARAMS)
            assert c.finish_reason == "stop", c

        calls = {"raw httpx": raw, "raw, 8-conn pools": raw_pooled, "SGLangEngine": client_call}
        for call in calls.values():  # warm up connections and code paths
            await _run(min(500, n), concurrency, call)
        results = {name: await _run(n, concurrency, call) for name, call in calls.items()}
        await engine.aclose()
        for p in pools:
            await p.aclose()
    print(f"{n} requests, concurrency {concurrency}, 200-token prompt, 2-token answers, "
          f"fake server in another process, {os.cpu_count()} CPUs")
    for name, (wall, cpu) in results.items():
        print(f"  {name:18s} {n / wall:8.0f} req/s   {1e6 * cpu / n:7.0f} us CPU/request")
    ew, ec = results["SGLangEngine"]
    for base in ("raw httpx", "raw, 8-conn pools"):
        bw, bc = results[base]
        print(f"  SGLangEngine vs {base}: throughput {bw / ew:.2f}x, CPU per request {ec / bc:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    with FakeSGLangProcess("--output", "19,151645") as server:
        asyncio.run(bench(server.url, args.requests, args.concurrency))


if __name__ == "__main__":
    main()
