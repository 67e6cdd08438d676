"""Client CPU to read one streamed SGLang completion (partial rollouts stream every request).

SGLang sends one SSE chunk per decoded token. By default each chunk repeats the whole output so
far (`output_ids`, `text`, `output_token_logprobs`): a completion of n tokens is n chunks of up to n
entries, O(n^2) bytes to parse. With `--incremental-streaming-output` each chunk holds its new
token only. This times what the client does with the chunks of one completion, built here in the
shape of the fixtures (`tests/data/sglang/generate_stream_*.json`): split the events, parse
each with orjson, fold it (`StreamFold.feed`), as `ServerPool._read_sse` does; no network.

    python bench/sglang_stream.py [--tokens 256 1024 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import orjson

from agentgrpo.engine.sglang.protocol import StreamFold


def chunks(n: int, incremental: bool) -> list[bytes]:
    """The SSE events of one n-token completion, the version changing halfway."""
    out = []
    for k in range(1, n + 1):
        lo = k - 1 if incremental else 0
        meta = {
            "id": "0123456789abcdef0123456789abcdef",
            "finish_reason": {"type": "length", "length": n} if k == n else None,
            "prompt_tokens": 300,
            "weight_version": "7" if k <= n // 2 else "8",
            "num_retractions": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": [[-0.25 - 1e-4 * i, 1000 + i, None] for i in range(lo, k)],
            "output_token_logprobs_length": k,
            "reasoning_tokens": 0,
            "completion_tokens": k,
            "cached_tokens": 256,
        }
        body = {"text": "ab" * (k - lo), "output_ids": list(range(1000 + lo, 1000 + k))}
        out.append(b"data: " + orjson.dumps({**body, "meta_info": meta}) + b"\n\n")
    return out + [b"data: [DONE]\n\n"]


def read(events: list[bytes]) -> StreamFold:
    fold = StreamFold()
    for e in events:
        payload = e[6:-2]
        if payload == b"[DONE]":
            break
        fold.feed(orjson.loads(payload))
    return fold


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print("| tokens | chunks | cumulative: MB, CPU ms | incremental: MB, CPU ms |")
    print("|---|---|---|---|")
    for n in args.tokens:
        row = [str(n), str(n)]
        for incremental in (False, True):
            events = chunks(n, incremental)
            times = []
            for _ in range(args.repeats):
                t0 = time.process_time()
                fold = read(events)
                times.append(time.process_time() - t0)
            assert fold.version_runs(None) == [(n // 2, "7"), (n - n // 2, "8")]
            mb = sum(len(e) for e in events) / 1e6
            row.append(f"{mb:.1f}, {1e3 * statistics.median(times):.1f}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
