"""An agent that plays a training run's episodes from another process (`env: {name: remote}`).

It asks the run for an episode, plays the calculator task against the episode's `base_url` with
the plain OpenAI client (the episode's own `api_key`) and the calculator tool, scores its own
answer and posts the reward; then asks for the next. It knows nothing of agentgrpo but the
episode API (docs/agents.md). The run and its agents share a token, loopback or not:

    export AGENTGRPO_POLICY_TOKEN=$(openssl rand -hex 32)
    agentgrpo train examples/remote.yaml &             # the run: waits for agents on port 8100
    python examples/remote_agent.py --url http://127.0.0.1:8100

With `--rubric` it ends each episode without a reward (DELETE) and the run's verifier scores it.
It stops after `--episodes` episodes, or when no task came for `--idle-s` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from fractions import Fraction

import httpx
import openai

from tools.calculator import calculator

SYSTEM = "Call the calculator tool to compute the answer, then reply with only the final number."


async def play(client: openai.AsyncOpenAI, task: dict, max_turns: int) -> str:
    """The agent: chat with the calculator tool until the model answers without a call."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    answer = ""
    for _ in range(max_turns):
        try:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[calculator.schema]
            )
        except openai.BadRequestError:  # the run's limit for this episode (code episode_limit)
            break
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # noqa: BLE001 - the model's arguments: tell it what failed
                result = f"error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return answer


def score(answer: str, expected: object) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer.replace(",", ""))
    return float(bool(numbers) and Fraction(numbers[-1]) == Fraction(str(expected)))


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8100", help="the run's episode server")
    p.add_argument("--episodes", type=int, default=None, help="stop after this many")
    p.add_argument("--idle-s", type=float, default=120.0, help="stop when no task came this long")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--rubric", action="store_true", help="leave the reward to the run's verifier")
    args = p.parse_args()
    token = os.environ.get("AGENTGRPO_POLICY_TOKEN")
    if not token:
        raise SystemExit("remote agent: set AGENTGRPO_POLICY_TOKEN to the run's token")
    headers = {"Authorization": f"Bearer {token}"}  # the episode API's; calls use the episode's
    played, idle_since = 0, time.monotonic()
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=90) as http:
        while args.episodes is None or played < args.episodes:
            if time.monotonic() - idle_since > args.idle_s:
                break
            try:
                r = await http.post("/episodes", json={"wait_s": 10})
            except httpx.TransportError:  # the run has not started serving yet
                await asyncio.sleep(1)
                continue
            if r.status_code == 204:  # no task now (the run is training): ask again
                continue
            r.raise_for_status()
            episode = r.json()
            client = openai.AsyncOpenAI(
                base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0
            )
            async with client:
                answer = await play(client, episode["task"], args.max_turns)
            if args.rubric:
                await http.delete(f"/episodes/{episode['id']}")
            else:
                reward = score(answer, episode["task"]["answer"])
                await http.post(f"/episodes/{episode['id']}/reward", json={"reward": reward})
            played, idle_since = played + 1, time.monotonic()
    print(f"remote agent: {played} episodes played", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
