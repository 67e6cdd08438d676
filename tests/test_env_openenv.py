"""The OpenEnv adapter (envs/openenv_env.py) against a real OpenEnv server (openenv-core's
`create_app`, tests/data/openenv/guess_env.py) started locally: episodes over its session
protocol, token-exact; a rejected action is the model's parse error; a server that fails is NaN,
never 0; a full server is waited for; one training step on the embedded model."""

from __future__ import annotations

import asyncio
import math
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

if os.environ.get("AGENTGRPO_FLOORS"):  # an optional extra: not floored (docs/development.md)
    try:
        import openenv.core  # noqa: F401
    except Exception as e:  # noqa: BLE001 - its fastapi needs pydantic>2.6 (IncEx)
        pytest.skip(
            f"openenv-core does not import on the dependency floors: {type(e).__name__}: {e}",
            allow_module_level=True,
        )

from agentgrpo import StopReason, check_env
from agentgrpo.cli import main
from agentgrpo.engine import SamplingParams
from agentgrpo.env.base import get_env_class
from agentgrpo.rollout.episode import EpisodeLimits, run_group
from agentgrpo.run.log import read_jsonl
from envs.openenv_env import OpenEnvEnv, string_fields
from tests.conftest import DATA
from tests.fakes import ScriptedEngine
from tests.test_agent_env import _record_sampled, assert_token_exact, by_turn  # noqa: F401
from tests.test_train_e2e import _check_run_dir

SERVER = str(DATA / "openenv")
TASKS = OpenEnvEnv.load_tasks("train", seed=0, n=4)


def secret(task) -> int:
    return random.Random(task.metadata["seed"]).randint(1, 10)  # as guess_env picks it


def local(**kw) -> OpenEnvEnv:
    return OpenEnvEnv(app="guess_env:app", cwd=SERVER, **kw)


def _group(chat, script, make_env=local, n=1, task=TASKS[0], max_turns=4):
    engine = ScriptedEngine(chat.tokenizer, script, chat.end_of_turn_id)
    g = asyncio.run(
        run_group(
            make_env,
            engine,
            chat,
            task,
            n,
            SamplingParams(max_new_tokens=16, seed=3),
            seed=0,
            limits=EpisodeLimits(max_turns=max_turns, max_tokens=256, episode_timeout_s=120),
        )
    )
    return g.trajectories, engine


@pytest.fixture
def served(tmp_path):
    """A guess_env server of our own, with extra environment variables, reached by URL."""
    procs = []

    def start(**env) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "uvicorn", "guess_env:app", "--port", str(port)]
        proc = subprocess.Popen(
            cmd, cwd=SERVER, env={**os.environ, **env}, stderr=subprocess.DEVNULL
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                return url
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the test server did not start")

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def test_found_by_name_and_tasks_are_seeded_per_split():
    assert get_env_class("openenv") is OpenEnvEnv
    train, evals = OpenEnvEnv.load_tasks("train", 0, n=50), OpenEnvEnv.load_tasks("eval", 0, n=50)
    again = OpenEnvEnv.load_tasks("train", 0, n=50)
    assert [t.metadata for t in train] == [t.metadata for t in again]
    assert not {t.metadata["seed"] for t in train} & {t.metadata["seed"] for t in evals}
    with pytest.raises(ValueError, match="exactly one of url"):
        OpenEnvEnv()
    assert string_fields({"properties": {"metadata": {"type": "object"}, "a": {"type": "string"}}})
    assert string_fields({"properties": {"a": {"type": "integer"}}}) == []


def test_an_episode_over_the_session_protocol_is_token_exact(chat):
    task = TASKS[0]
    wrong = str(secret(task) % 10 + 1)
    trajs, engine = _group(chat, by_turn(chat, wrong, str(secret(task))), task=task)
    (t,) = trajs
    assert t.stop_reason == StopReason.COMPLETED, t.stop_detail
    assert t.num_turns == 2 and t.reward == 1.0 and t.turn_rewards == (0.0, 1.0)
    assert_token_exact(t, engine)
    assert [m.role for m in t.messages] == ["user", "assistant", "user", "assistant"]
    assert t.messages[0].content.startswith("Guess my number") and "No, " in t.messages[2].content


def test_a_rejected_action_is_the_models_parse_error(chat):
    (t,), _ = _group(chat, [""])  # the action schema wants at least one character
    assert t.stop_reason == StopReason.PARSE_ERROR and t.reward == 0.0
    assert "string_too_short" in t.env_info["refused"]


def test_a_full_server_is_waited_for(chat):
    # the server holds 2 sessions at once; 4 episodes in flight all finish
    trajs, _ = _group(chat, lambda ids, i: "11", n=4, max_turns=2)
    assert [t.stop_reason for t in trajs] == [StopReason.MAX_TURNS] * 4
    assert all(t.reward == 0.0 for t in trajs)


def test_server_failures_are_unscorable_not_zero(chat, served):
    broken = served(GUESS_FAIL_STEP="1")
    (t,), _ = _group(chat, ["3"], make_env=lambda: OpenEnvEnv(url=broken))
    assert t.stop_reason == StopReason.ENV_ERROR and math.isnan(t.reward)
    assert "the game's database is down" in t.stop_detail
    with socket.socket() as s:  # a port nobody serves
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    (t,), _ = _group(chat, ["3"], make_env=lambda: OpenEnvEnv(url=dead, start_timeout_s=1))
    assert t.stop_reason == StopReason.ENV_ERROR and math.isnan(t.reward)
    assert "not healthy" in t.stop_detail


def test_check_env_passes():
    check_env(local(system_prompt="Play the game."), TASKS[1])


@pytest.mark.slow
def test_one_training_step_on_the_embedded_model(tmp_path, smol_path):
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "examples/openenv.yaml",
            f"output_dir={out}",
            f"model.path={smol_path}",
            f"env.kwargs.cwd={SERVER}",
            "train.steps=1",
            "rollout.group_size=2",
            "rollout.tasks_per_step=2",
            "rollout.max_new_tokens=8",
            "rollout.max_tokens=64",
            "log.progress=false",
        ]
    )
    assert rc == 0
    _check_run_dir(out, 1)  # token-exact rows, finite loss and reward
    rows = read_jsonl(out / "trajectories.jsonl")
    assert all(r["messages"][1]["content"].startswith("Guess my number") for r in rows)
