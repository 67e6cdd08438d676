"""Multi-turn rollouts on the real SmolLM2 tokenizer with a scripted engine: the trajectory
invariants, and every way an episode can end."""

import asyncio
import math

import pytest

from agentgrpo import Env, Message, StopReason
from agentgrpo.engine import SamplingParams
from agentgrpo.engine.base import EngineError
from agentgrpo.rollout import RolloutConfig, collect, run_episode, run_group
from envs.calculator import CalculatorEnv
from tests.fakes import ScriptedEngine

TASK = CalculatorEnv.load_tasks("train", seed=0, n=1)[0]  # "What is 56 + 55?" -> 111
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "56+55"}}\n</tool_call>'


def run(chat, script, *, env=CalculatorEnv, task=TASK, **kw):
    engine = ScriptedEngine(chat.tokenizer, script, chat.end_of_turn_id)
    traj = asyncio.run(run_episode(env(), engine, chat, task, SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 64)), **kw))
    return traj, engine


def assert_invariants(traj, engine, chat):
    """Lengths match; mask 1 exactly on sampled ids, with the engine's logprobs; the sequence the
    engine saw at each turn is a prefix of the final trajectory."""
    traj.check()
    assert traj.token_ids[: traj.prompt_len] == engine.calls[0]
    sampled_positions = []
    for k, prompt in enumerate(engine.calls):
        assert traj.token_ids[: len(prompt)] == prompt  # the model saw exactly these tokens
        end = engine.calls[k + 1].__len__() if k + 1 < len(engine.calls) else len(traj.token_ids)
        # sampled ids of turn k start right after its prompt
        n = next(i for i in range(len(prompt), end + 1) if i == end or traj.loss_mask[i] == 0)
        sampled_positions += list(range(len(prompt), n))
    assert [i for i, m in enumerate(traj.loss_mask) if m] == sampled_positions
    assert all(lp < 0 for lp, m in zip(traj.logprobs, traj.loss_mask) if m)


def test_tool_call_then_answer(chat):
    traj, engine = run(chat, [CALL, "The answer is 111."])
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0
    assert (traj.num_turns, traj.tool_calls, traj.tool_errors) == (2, 1, 0)
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert traj.messages[3].content == "111"
    assert_invariants(traj, engine, chat)
    # the full trajectory is exactly the template's rendering of the conversation
    tools = CalculatorEnv().tool_schemas()
    text = chat.decode(traj.token_ids)
    assert text == chat.render(traj.messages[:2], tools, add_generation_prompt=True) + chat.decode(traj.token_ids[traj.prompt_len:])
    assert traj.token_ids[-1] == chat.end_of_turn_id


def test_malformed_calls_are_answered_and_counted(chat):
    script = ['<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
              '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>',
              '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
              "111"]
    traj, engine = run(chat, script, max_turns=5)
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0
    assert (traj.tool_calls, traj.tool_errors) == (3, 3)
    tool_msgs = [m.content for m in traj.messages if m.role == "tool"]
    assert "not valid JSON" in tool_msgs[0]
    assert "unknown tool 'abacus'" in tool_msgs[1]
    assert "expression: Field required" in tool_msgs[2]
    assert_invariants(traj, engine, chat)


def test_tool_error_penalty(chat):
    traj, _ = run(chat, ['<tool_call>{bad</tool_call>', "111"], tool_error_penalty=0.25)
    assert traj.reward == pytest.approx(0.75)


def test_limits_end_the_episode(chat):
    traj, engine = run(chat, [CALL], max_turns=3)
    assert traj.stop_reason == StopReason.MAX_TURNS and traj.num_turns == 3 and traj.reward == 0.0
    assert_invariants(traj, engine, chat)
    traj, _ = run(chat, ["1 " * 100], max_new_tokens=16)
    assert traj.stop_reason == StopReason.MAX_TOKENS and traj.num_sampled == 16
    traj, _ = run(chat, [CALL], max_turns=10, max_tokens=60)
    assert traj.stop_reason == StopReason.MAX_TOKENS
    assert len(traj.token_ids) - traj.prompt_len <= 60 + 20  # the budget is checked before each turn


def test_infrastructure_failures_are_unscorable_not_zero(chat):
    traj, _ = run(chat, lambda ids, i: EngineError("connection refused"))
    assert traj.stop_reason == StopReason.ENGINE_ERROR and math.isnan(traj.reward)
    assert "connection refused" in traj.stop_detail

    class Broken(CalculatorEnv):
        async def step(self, action):
            raise KeyError("state")

    traj, _ = run(chat, ["111"], env=Broken)
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward)
    assert "step raised KeyError" in traj.stop_detail

    class BrokenReset(CalculatorEnv):
        def reset(self, *, seed=None, options=None):
            raise OSError("dataset missing")

    traj, _ = run(chat, ["111"], env=BrokenReset)
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward) and traj.token_ids == []


def test_plain_env_with_user_feedback(chat):
    class Guess(Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed, options=options)
            return [Message(role="user", content="Guess my number (1-3).")], {}

        def step(self, action):
            if action.content.strip() == "2":
                return [], 1.0, True, False, {}
            return [Message(role="user", content="No, try again.")], 0.0, False, False, {}

    traj, engine = run(chat, ["1", "3", "2"], env=Guess, max_turns=5)
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0 and traj.num_turns == 3
    assert_invariants(traj, engine, chat)


def test_group_members_share_task_and_env_seed(chat):
    seeds = []

    class Recording(CalculatorEnv):
        def reset(self, *, seed=None, options=None):
            seeds.append(seed)
            return super().reset(seed=seed, options=options)

    engine = ScriptedEngine(chat.tokenizer, ["111", "112"], chat.end_of_turn_id)
    g = asyncio.run(run_group(Recording, engine, chat, TASK, 4, SamplingParams(seed=10), seed=7))
    assert seeds == [7] * 4 and len(g.trajectories) == 4
    assert sorted(t.reward for t in g.trajectories) == [0.0, 0.0, 1.0, 1.0]
    assert {t.group_id for t in g.trajectories} == {TASK.id}


def test_collect_runs_groups_concurrently(chat):
    engine = ScriptedEngine(chat.tokenizer, [CALL, "111"], chat.end_of_turn_id, delay_s=0.05)
    tasks = CalculatorEnv.load_tasks("train", seed=0, n=4)
    done = []
    import time

    t0 = time.monotonic()
    groups = asyncio.run(collect(CalculatorEnv, engine, chat, tasks, RolloutConfig(group_size=4), on_done=done.append))
    assert len(groups) == 4 and len(done) == 16
    assert len({g.group_id for g in groups}) == 4
    # 16 episodes x >= 2 turns x 50 ms would take >= 1.6 s one after another
    assert time.monotonic() - t0 < 1.2
