"""The agent examples as users write them (the Agents SDK on its default Responses model, the
`anthropic` client with tool use, a LangGraph ReAct agent): each plays the calculator task
token-exactly through an AgentEnv's endpoint with a scripted engine, and each trains one step
on the embedded model."""

import asyncio
import importlib
import math
import os

import pytest

from agentgrpo import StopReason
from agentgrpo.engine import SamplingParams
from agentgrpo.rollout.episode import EpisodeLimits, run_group
from agentgrpo.run.log import read_jsonl
from tests.agent_apis import Recording, assert_sampled_by_engine, by_turn

# (module, class, the package it needs); optional: on the dependency floors they may not import
EXAMPLES = [
    ("examples.openai_agents_sdk", "CalculatorSDKAgent", "agents"),
    ("examples.anthropic_agent", "CalculatorClaudeAgent", "anthropic"),
    ("examples.langgraph_agent", "CalculatorGraphAgent", "langgraph"),
]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "56+55"}}\n</tool_call>'


def example(module, name, needs):
    pytest.importorskip(needs, exc_type=ImportError)
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - on the floors only: langgraph's langsmith needs pydantic>2.6
        if not os.environ.get("AGENTGRPO_FLOORS"):
            raise
        pytest.skip(f"{needs} does not import on the dependency floors: {type(e).__name__}: {e}")


@pytest.mark.parametrize("module,name,needs", EXAMPLES, ids=[e[2] for e in EXAMPLES])
def test_example_plays_token_exact(chat, module, name, needs):
    env = example(module, name, needs)
    [task] = env.load_tasks("train", seed=0, n=1)  # What is 56 + 55?
    engine = Recording(
        chat.tokenizer, by_turn(chat, CALL, "The answer is 111."), chat.end_of_turn_id
    )
    group = asyncio.run(
        run_group(
            env,
            engine,
            chat,
            task,
            2,
            SamplingParams(max_new_tokens=64, seed=3),
            seed=0,
            limits=EpisodeLimits(max_turns=4, max_tokens=512),
        )
    )
    for traj in group.trajectories:
        assert traj.stop_reason == StopReason.COMPLETED, traj.stop_detail
        assert traj.reward == 1.0 and traj.num_turns == 2 and traj.tool_calls == 1
        assert not traj.segments[1:], "the agent's second call did not continue its first"
        assert_sampled_by_engine(traj, engine)


@pytest.mark.slow
@pytest.mark.parametrize("module,name,needs", EXAMPLES, ids=[e[2] for e in EXAMPLES])
def test_example_trains_one_step_on_the_embedded_model(tmp_path, smol_path, module, name, needs):
    from agentgrpo.cli import main

    example(module, name, needs)
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "examples/openai_agent.yaml",
            f"env.name={module}:{name}",
            f"output_dir={out}",
            f"model.path={smol_path}",
            "train.steps=1",
            "rollout.group_size=2",
            "rollout.tasks_per_step=1",
            "rollout.max_new_tokens=48",
            "rollout.max_tokens=160",
            "log.progress=false",
        ]
    )
    assert rc == 0
    [metrics] = read_jsonl(out / "metrics.jsonl")
    assert math.isfinite(metrics["loss"]) and metrics["sampled_tokens"] > 0
    rows = read_jsonl(out / "trajectories.jsonl")
    assert len(rows) == 2 and all(r["stop_reason"] != "env_error" for r in rows), rows[0][
        "stop_detail"
    ]
