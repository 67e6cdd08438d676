"""What a JudgeVerifier costs per group, with serve-policy (the embedded model) as the judge.

Starts `agentgrpo serve-policy` over the embedded SmolLM2-135M-Instruct, then scores groups of 8
one-turn answers to sums, once per trajectory (8 requests a group) and once per group (one request,
RULER's mode). Prints, per group: wall time, requests, the judge's prompt and completion tokens
(its `usage`), and how many of the 8 it scored (the rest are NaN: an answer that was not the JSON
asked for). Cache off and no retries, so each group pays in full.

    python bench/judge_cost.py
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import time
import urllib.request

from agentgrpo.env.rubric import Rubric
from agentgrpo.models.embedded import default_model_path
from agentgrpo.types import Message, StopReason, Task, Trajectory
from agentgrpo.verify.judge import JudgeVerifier

RUBRIC = "10 when the answer is the right number, 0 when it is wrong or missing."
TASKS = [
    Task(id=str(i), prompt=f"What is {a} + {b}?", answer=str(a + b))
    for i, (a, b) in enumerate([(2, 2), (13, 29), (40, 5)])
]


def group(task: Task) -> list[Trajectory]:
    a = int(task.answer)
    texts = [f"{a}", f"The answer is {a}.", f"{a + 1}", "I do not know.", f"{a - 1}"]
    texts += [f"It is {a}, since I added them.", f"{a * 2}", f"{a}!"]
    return [
        Trajectory(
            task_id=task.id,
            token_ids=[],
            loss_mask=[],
            logprobs=[],
            prompt_len=0,
            messages=[*task.prompt_messages(), Message(role="assistant", content=text)],
            stop_reason=StopReason.COMPLETED,
        )
        for text in texts
    ]


def serve_policy() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "agentgrpo.cli", "serve-policy", str(default_model_path())]
    proc = subprocess.Popen([*cmd, "--port", str(port)], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{base}/v1/models", timeout=1)
            return proc, base
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit("serve-policy did not start")


def episode(base: str, name: str) -> str:
    body = json.dumps({"id": name}).encode()
    req = urllib.request.Request(f"{base}/episodes", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["base_url"]


def main() -> None:
    proc, base = serve_policy()
    try:
        for mode in ("pointwise", "group"):
            judge = JudgeVerifier(
                base_url=episode(base, mode),
                model="policy",
                rubric=RUBRIC,
                max_score=10,
                group=mode == "group",
                response_format="text",  # serve-policy has no structured output
                max_tokens=96,
                retries=0,
                cache_size=0,
            )
            rubric = Rubric([("judge", judge, 1.0)])
            for task in TASKS:
                trajs, calls = group(task), judge.calls
                t0 = time.perf_counter()
                results = asyncio.run(rubric.ascore_group(trajs, task))
                wall = time.perf_counter() - t0
                asked = results if mode == "pointwise" else results[:1]  # group: one answer
                usage = [json.loads(r.info["judge"]["answer"])["usage"] for r in asked]
                scored = sum(not math.isnan(r.score) for r in results)
                print(
                    f"{mode:9s} group {task.id}: {wall:5.2f} s, {judge.calls - calls} requests, "
                    f"{sum(u['prompt_tokens'] for u in usage)} prompt + "
                    f"{sum(u['completion_tokens'] for u in usage)} completion tokens, "
                    f"{scored}/8 scored",
                    flush=True,
                )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
