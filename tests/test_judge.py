"""Judges (agentgrpo/verify/judge.py): an LLM judge and a reward model behind HTTP, scripted here
by a real local server; NaN when they fail, never 0; retries, cache, bounded concurrency; the
group-relative mode (one call ranks a group); serve-policy as the judge on a CPU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentgrpo.env.rubric import Rubric, score_group
from agentgrpo.types import Message, Score, StopReason, Task, Trajectory
from agentgrpo.verify.judge import JudgeConfig, JudgeVerifier, RewardModelVerifier

TASK = Task(id="t", prompt="What is 2 + 2?", answer="4")


def traj(answer: str, member: int = 0) -> Trajectory:
    return Trajectory(
        id=f"g/{member}",
        task_id="t",
        token_ids=[],
        loss_mask=[],
        logprobs=[],
        prompt_len=0,
        messages=[*TASK.prompt_messages(), Message(role="assistant", content=answer)],
        stop_reason=StopReason.COMPLETED,
    )


def members(*answers: str) -> list[Trajectory]:
    return [traj(a, i) for i, a in enumerate(answers)]


def chat_reply(content: str) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


class Scripted:
    """A judge server: `answer(request_json, n) -> (status, json)`; records requests, the most in
    flight, and how long each took."""

    def __init__(self, answer, delay_s: float = 0.0) -> None:
        self.answer, self.delay_s = answer, delay_s
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    async def handle(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            status, data = self.answer(body, len(self.requests))
        finally:
            self.in_flight -= 1
        return JSONResponse(data, status_code=status)

    @contextlib.asynccontextmanager
    async def serving(self):
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.handle, methods=["POST"]),
                Route("/classify", self.handle, methods=["POST"]),
            ]
        )
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await task


def judged(answer, fn, delay_s=0.0):
    """Run `fn(base_url, server)` against a scripted judge."""

    async def main():
        server = Scripted(answer, delay_s)
        async with server.serving() as url:
            return await fn(url, server), server

    return asyncio.run(main())


def scores_json(score: float, why: str = "ok") -> str:
    return json.dumps({"explanation": why, "score": score})


def test_a_trajectory_is_scored_with_structured_output_and_the_exchange_is_recorded():
    t = traj("4")

    async def fn(url, _):
        judge = JudgeVerifier(base_url=f"{url}/v1", rubric="right answers score 10", max_score=10)
        return await judge(t, TASK)

    result, server = judged(lambda body, n: (200, chat_reply(scores_json(8, "correct"))), fn)
    assert result.score == 0.8 and result.detail == "correct" and result.info["kind"] == "judge"
    (req,) = server.requests
    assert req["response_format"]["type"] == "json_schema" and req["temperature"] == 0.0
    assert "right answers score 10" in req["messages"][0]["content"]
    assert "[assistant]\n4" in req["messages"][1]["content"]
    assert "Reference answer: 4" in req["messages"][1]["content"]
    record = result.info
    assert record["prompt"] == req["messages"] and json.loads(record["answer"])["choices"]
    assert record["score"] == 0.8 and record["attempts"] == 1 and not record["cached"]


def test_transient_failures_and_unparsable_answers_are_retried():
    replies = [(503, {"error": "busy"}), (200, chat_reply("I think it is fine")), None]

    def answer(body, n):
        return replies[n - 1] or (200, chat_reply(f"Sure: {scores_json(1)}"))

    async def fn(url, _):
        judge = JudgeVerifier(base_url=f"{url}/v1", rubric="r", backoff_s=0.01, retries=2)
        return await judge(traj("4"), TASK)

    result, server = judged(answer, fn)
    assert result.score == 1.0 and len(server.requests) == 3  # JSON found after some words


@pytest.mark.parametrize(
    "answer, attempts",
    [
        (lambda body, n: (500, {"error": "down"}), 3),  # retried, then NaN
        (lambda body, n: (200, chat_reply("no score here")), 3),
        (lambda body, n: (200, chat_reply(scores_json(7))), 3),  # outside [0, max_score]
        (lambda body, n: (401, {"error": "no key"}), 1),  # not worth asking again
    ],
)
def test_a_failing_judge_gives_nan_never_zero(answer, attempts):
    trajs = members("4", "5")

    async def fn(url, _):
        judge = JudgeVerifier(base_url=f"{url}/v1", rubric="r", backoff_s=0.0, cache_size=0)
        rubric = Rubric([("judge", judge, 1.0)])
        return await score_group(rubric, trajs, TASK)

    scores, server = judged(answer, fn)
    assert [s.trajectory_id for s in scores] == ["g/0", "g/1"]
    assert all(math.isnan(s.reward) for s in scores)
    assert all("unscorable" in s.detail and "judge failed" in s.detail for s in scores)
    assert len(server.requests) == 2 * attempts and "error" in scores[0].info["judge"]


def test_an_unreachable_judge_gives_nan():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    judge = JudgeVerifier(base_url=url, rubric="r", retries=1, backoff_s=0.0)
    result = asyncio.run(judge(traj("4"), TASK))
    assert math.isnan(result.score) and "after 2 attempts" in result.detail


def test_answers_are_cached_by_content_and_requests_bounded():
    trajs = members("4", "4", "5", "6", "7", "8")

    async def fn(url, _):
        judge = JudgeVerifier(base_url=f"{url}/v1", rubric="r", max_concurrency=2)
        rubric = Rubric([("judge", judge, 1.0)])
        first = await rubric.ascore_group(trajs, TASK)
        again = await rubric.ascore_group(trajs[:1], TASK)
        return first, again, judge

    (first, again, judge), server = judged(
        lambda body, n: (200, chat_reply(scores_json(0.5))), fn, delay_s=0.05
    )
    assert [r.score for r in first] == [0.5] * 6
    # the two identical "4" episodes may both be asked (concurrently); the repeat later is not
    assert len(server.requests) <= 6 and judge.calls == len(server.requests)
    assert again[0].score == 0.5 and again[0].info["judge"]["cached"] is True
    assert server.max_in_flight <= 2


def test_the_group_mode_ranks_a_group_in_one_call():
    trajs = members("4", "five", "4, since 2 + 2 = 4")

    def answer(body, n):
        text = body["messages"][1]["content"]
        assert "=== Episode 3 ===" in text and "ids 1 to 3" in text
        scores = [
            {"id": i, "explanation": f"#{i}", "score": s} for i, s in [(1, 0.6), (2, 0), (3, 1)]
        ]
        return 200, chat_reply(json.dumps({"scores": scores}))

    async def fn(url, _):
        judge = JudgeVerifier(base_url=f"{url}/v1", rubric="r", group=True)
        rubric = Rubric([("ruler", judge, 1.0)])
        return await score_group(rubric, trajs, TASK)

    scores, server = judged(answer, fn)
    assert len(server.requests) == 1
    assert [s.reward for s in scores] == [0.6, 0.0, 1.0]
    assert [s.info["ruler"]["id"] for s in scores] == [1, 2, 3]
    assert server.requests[0]["response_format"]["json_schema"]["schema"]["required"] == ["scores"]


def test_the_group_mode_needs_a_score_for_every_member():
    trajs = members("4", "5")
    only_one = json.dumps({"scores": [{"id": 1, "explanation": "", "score": 1}]})

    async def fn(url, _):
        judge = JudgeVerifier(base_url=f"{url}/v1", rubric="r", group=True, backoff_s=0.0)
        return await Rubric([("ruler", judge, 1.0)]).ascore_group(trajs, TASK)

    results, server = judged(lambda body, n: (200, chat_reply(only_one)), fn)
    assert all(math.isnan(r.score) for r in results) and len(server.requests) == 3
    assert "not 1..2" in results[0].detail


def test_a_reward_model_server_scores_and_fails_as_nan():
    t = traj("4")

    async def fn(url, _):
        good = RewardModelVerifier(base_url=url, model="rm", score_path="data.0.probs.1")
        bad = RewardModelVerifier(base_url=url, model="rm", score_path="data.0.logits")
        return await good(t, TASK), await bad(traj("5"), TASK)

    (ok, broken), server = judged(
        lambda body, n: (200, {"data": [{"index": 0, "probs": [0.25, 0.75]}]}), fn
    )
    assert ok.score == 0.75 and ok.info["kind"] == "reward model" and ok.info["score"] == 0.75
    assert json.loads(ok.info["answer"])["data"][0]["probs"] == [0.25, 0.75]
    assert server.requests[0]["messages"][-1] == {"role": "assistant", "content": "4"}
    assert math.isnan(broken.score) and "data.0.logits" in broken.detail


def test_config_is_checked_at_construction(monkeypatch):
    with pytest.raises(ValueError, match="rubric"):
        JudgeConfig(base_url="http://x")
    with pytest.raises(ValueError, match="extra"):
        JudgeConfig(base_url="http://x", rubric="r", temprature=1)
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(ValueError, match="NO_SUCH_KEY_VAR is not set"):
        JudgeVerifier(base_url="http://x", rubric="r", api_key_env="NO_SUCH_KEY_VAR")


# --- serve-policy as the judge, on a CPU ---------------------------------------------------------

RUBRIC = "10 when the answer is the right number, 0 when it is wrong or missing."


@pytest.fixture(scope="module")
def serve_policy(smol_path, tmp_path_factory):
    """`agentgrpo serve-policy` over the embedded model, in its own process, with a token; an
    episode's URL and its own key."""
    token = tmp_path_factory.mktemp("serve") / "token"
    token.write_text("judge-t0ken\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "agentgrpo.cli",
        "serve-policy",
        str(smol_path),
        "--port",
        str(port),
        "--token-file",
        str(token),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=1)
                break
            except urllib.error.HTTPError:  # 401 without the token: it answers
                break
            except OSError:
                time.sleep(0.2)
        req = urllib.request.Request(
            f"{base}/episodes",
            data=b'{"id": "judge"}',
            method="POST",
            headers={"Authorization": "Bearer judge-t0ken"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            episode = json.loads(r.read())
        yield episode["base_url"], episode["api_key"]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True])
def test_serve_policy_judges_a_group_on_a_cpu(serve_policy, group, monkeypatch):
    base_url, key = serve_policy
    monkeypatch.setenv("JUDGE_EPISODE_KEY", key)
    trajs = members("4", "The answer is 4.", "5", "I do not know.")
    judge = JudgeVerifier(
        base_url=base_url,
        api_key_env="JUDGE_EPISODE_KEY",
        model="policy",
        rubric=RUBRIC,
        max_score=10,
        group=group,
        response_format="text",  # serve-policy samples the policy as it is: no structured output
        max_tokens=96,
        retries=1,
        backoff_s=0.0,
    )
    results = asyncio.run(Rubric([("judge", judge, 1.0)]).ascore_group(trajs, TASK))
    assert judge.calls >= 1
    for r in results:
        # a 135M policy is a poor judge: each result is a score it gave, or NaN saying why
        assert (0.0 <= r.score <= 1.0) or (math.isnan(r.score) and "judge failed" in r.detail)
        record = r.info["judge"]
        assert record["prompt"][0]["role"] == "system" and RUBRIC in record["prompt"][0]["content"]
        assert "answer" in record or "error" in record


def test_the_report_shows_what_the_judge_was_asked_and_answered(tmp_path):
    import html

    from agentgrpo.run.report import write_report

    t, failed = members("4", "5")
    asked = {
        "kind": "judge",
        "model": "judge",
        "prompt": [{"role": "system", "content": "Rubric: <b>be right</b>"}],
        "answer": json.dumps(chat_reply(scores_json(1, "<script>x</script> correct"))),
        "score": 1.0,
    }
    failure = {"kind": "judge", "model": "judge", "prompt": [], "error": "after 3 attempts: 503"}
    scores = [
        Score(t.id, 1.0, info={"judge": asked}),
        Score(failed.id, math.nan, info={"judge": failure}),
    ]
    rows = [{**x.to_dict(s), "step": 1} for x, s in zip((t, failed), scores)]
    (tmp_path / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(tmp_path).read_text()
    assert page.count('<details class="judge">') == 2
    assert html.escape("Rubric: <b>be right</b>") in page and "<b>be right</b>" not in page
    assert html.escape('"explanation": "<script>x</script> correct"') in page
    assert "judge: judge judge: score 1" in page
    assert "judge: judge judge: after 3 attempts: 503" in page
