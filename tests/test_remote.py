"""`env: {name: remote}`: episodes handed out through the episode API to agents in other
processes (examples/remote_agent.py), recorded token-exactly, ended by the agent's reward or the
env's rubric, and by their deadline when no agent takes or ends them; a run trains on them."""

import asyncio
import math
import socket
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("openai")

from agentgrpo import StopReason, Task  # noqa: E402
from agentgrpo.agents.remote import RemoteEnv, stop_servers  # noqa: E402
from agentgrpo.rollout.episode import RolloutConfig, collect  # noqa: E402
from agentgrpo.run.log import read_jsonl  # noqa: E402
from tests.agent_apis import CALL, Recording, assert_sampled_by_engine, by_turn  # noqa: E402

TASKS = [
    Task(id="four", prompt="What is 2 + 2?", answer=4),
    Task(id="six: 3 + 3?", prompt="3 + 3?", answer=6),  # not an episode id: the run makes one
]


TOKEN = "remote-test-token"


@pytest.fixture
def port(monkeypatch):
    """A free port, and the token the run and its agents share (required on loopback too)."""
    monkeypatch.setenv("AGENTGRPO_POLICY_TOKEN", TOKEN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    yield free
    stop_servers()


def agent(port, *args):
    """examples/remote_agent.py in its own process."""
    return subprocess.Popen(
        [sys.executable, "examples/remote_agent.py", "--url", f"http://127.0.0.1:{port}", *args],
        stdout=subprocess.PIPE,
        text=True,
    )


def four(trajectory, task):
    """A verifier: the last message says 4."""
    return float(trajectory.messages[-1].content.strip() == "4")


def run(chat, port, script, *, verifier=None, also=None, **cfg):
    engine = Recording(chat.tokenizer, script, chat.end_of_turn_id)
    config = RolloutConfig(group_size=2, tasks_per_step=2, max_turns=3, max_new_tokens=64, **cfg)

    async def body():
        collecting = collect(
            lambda: RemoteEnv(port=port, verifier=verifier), engine, chat, TASKS, config
        )
        if also is None:
            return await collecting
        groups, _ = await asyncio.gather(collecting, also())
        return groups

    return asyncio.run(body()), engine


def test_an_agent_in_another_process_plays_the_runs_episodes(chat, port):
    proc = agent(port, "--episodes", "4")
    try:
        groups, engine = run(chat, port, by_turn(chat, CALL, "4"))
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "4 episodes played" in out
    rewards = {}
    for g in groups:
        for t in g.trajectories:
            assert t.stop_reason == StopReason.COMPLETED, t.stop_detail
            assert t.num_turns == 2 and t.tool_calls == 1
            rewards[g.task.id] = rewards.get(g.task.id, ()) + (t.reward,)
            assert_sampled_by_engine(t, engine)
    assert rewards == {"four": (1.0, 1.0), "six: 3 + 3?": (0.0, 0.0)}  # the agent's own scores


def test_deadlines_end_episodes_no_agent_takes_or_ends(chat, port):
    """One episode is taken and never ended, the other three are never taken: all four end at
    the episode deadline as TIMEOUT, unscorable, and the detail says which case it was."""

    async def take_one_and_walk_away():
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=auth) as http:
            for _ in range(50):
                try:
                    r = await http.post("/episodes", json={"wait_s": 5})
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            taken = r.json()
            assert r.status_code == 200 and taken["task"]["id"] in ("four", "six: 3 + 3?")
            # the hand-out needs the run's token (loopback too); the episode's own key opens
            # its calls only, not the episode API
            assert taken["anthropic_base_url"] + "/v1" == taken["base_url"]
            own = {"Authorization": f"Bearer {taken['api_key']}"}
            eid = taken["id"]
            refused = [
                await http.post("/episodes", json={"wait_s": 0}, headers={"Authorization": ""}),
                await http.post("/episodes", json={"wait_s": 0}, headers=own),
                await http.post(f"/episodes/{eid}/reward", json={"reward": 1}, headers=own),
                await http.delete(f"/episodes/{eid}", headers=own),
            ]
            assert [x.status_code for x in refused] == [401] * 4
            models = await http.get(f"/episodes/{eid}/v1/models", headers=own)
            assert models.status_code == 200

    groups, _ = run(chat, port, ["4"], also=take_one_and_walk_away, episode_timeout_s=2)
    details = sorted(t.stop_detail for g in groups for t in g.trajectories)
    assert all(
        t.stop_reason == StopReason.TIMEOUT and math.isnan(t.reward)
        for g in groups
        for t in g.trajectories
    )
    assert all("episode deadline of 2 s expired" in d for d in details)
    assert sum("its agent did not end it" in d for d in details) == 1
    assert sum("no agent took it" in d for d in details) == 3


def test_an_episode_ended_without_a_reward_is_scored_by_the_rubric(chat, port):
    proc = agent(port, "--episodes", "4", "--rubric")
    try:
        groups, _ = run(chat, port, by_turn(chat, CALL, "4"), verifier="tests.test_remote:four")
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    for g in groups:
        assert g.rewards == [1.0, 1.0]  # the verifier's: the last message says 4
        for t in g.trajectories:
            assert t.stop_reason == StopReason.COMPLETED


def test_tasks_of_another_env_and_a_token_on_every_address(monkeypatch):
    tasks = RemoteEnv.load_tasks("train", seed=0, env="calculator", n=3)
    assert len(tasks) == 3 and all(t.answer is not None for t in tasks)
    monkeypatch.delenv("AGENTGRPO_POLICY_TOKEN", raising=False)
    for host in ("0.0.0.0", "127.0.0.1"):  # any local user can reach a loopback port
        with pytest.raises(ValueError, match="without a token"):
            RemoteEnv(host=host)
    monkeypatch.setenv("AGENTGRPO_POLICY_TOKEN", TOKEN)
    with pytest.raises(ValueError, match="module:function"):
        RemoteEnv(verifier="nocolon")


def test_a_run_trains_two_steps_on_episodes_played_elsewhere(tmp_path, tiny_model_dir, port):
    """`agentgrpo train examples/remote.yaml` with examples/remote_agent.py in another process."""
    from agentgrpo.cli import main

    proc = agent(port, "--idle-s", "60")
    try:
        rc = main(
            [
                "train",
                "examples/remote.yaml",
                f"output_dir={tmp_path / 'run'}",
                f"model.path={tiny_model_dir}",
                f"env.kwargs.port={port}",
                "train.steps=2",
                "rollout.group_size=2",
                "rollout.tasks_per_step=2",
                "rollout.max_new_tokens=12",
                "rollout.max_tokens=40",
                "rollout.episode_timeout_s=120",
                "log.progress=false",
            ]
        )
    finally:
        proc.kill()
        proc.wait()
    assert rc == 0
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m.get("stop/timeout", 0) == 0 and math.isfinite(m["loss"]) for m in metrics)
    rows = read_jsonl(tmp_path / "run" / "trajectories.jsonl")
    assert len(rows) == 8 and all(r["reward"] in (0.0, 1.0) for r in rows)
