"""Multi-turn rollouts on the real SmolLM2 tokenizer with a scripted engine: the trajectory
invariants, and every way an episode can end."""

import asyncio
import json
import math
import threading
import time

import pytest

from agentgrpo import Env, EnvStep, Group, Message, StopReason, ToolEnv, tool
from agentgrpo.engine import Completion, SamplingParams
from agentgrpo.engine.base import EngineError
from agentgrpo.rollout.episode import (
    EpisodeLimits,
    RolloutConfig,
    collect,
    rollout_metrics,
    run_episode,
    run_group,
)
from envs.calculator import CalculatorEnv
from tests.fakes import FailingEngine, ScriptedEngine


class Calc(CalculatorEnv):
    """The calculator without its worked example in the prompt: the message checks stay short."""

    def __init__(self) -> None:
        super().__init__(demo=False)


TASK = Calc.load_tasks("train", seed=0, n=1)[0]  # "What is 56 + 55?" -> 111
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "56+55"}}\n</tool_call>'


def run(chat, script, *, env=Calc, task=TASK, max_new_tokens=64, delay_s=0.0, **limits):
    engine = ScriptedEngine(chat.tokenizer, script, chat.end_of_turn_id, delay_s=delay_s)
    traj = asyncio.run(
        run_episode(
            env(),
            engine,
            chat,
            task,
            SamplingParams(max_new_tokens=max_new_tokens),
            limits=EpisodeLimits(**limits),
        )
    )
    return traj, engine


def by_turn(chat, *texts):
    """A script that answers by the turn of the trajectory asking (not by global call order, which
    interleaves when many trajectories run at once)."""
    return lambda ids, i: texts[
        min(chat.decode(ids).count("<|im_start|>assistant") - 1, len(texts) - 1)
    ]


def assert_invariants(traj, engine, chat):
    """Lengths match; mask 1 exactly on sampled ids, with the engine's logprobs; the sequence the
    engine saw at each turn is a prefix of the final trajectory."""
    traj.check()
    assert list(traj.token_ids[: traj.prompt_len]) == engine.calls[0]
    sampled_positions = []
    for k, prompt in enumerate(engine.calls):
        assert list(traj.token_ids[: len(prompt)]) == prompt  # the model saw exactly these tokens
        end = engine.calls[k + 1].__len__() if k + 1 < len(engine.calls) else len(traj.token_ids)
        # sampled ids of turn k start right after its prompt
        n = next(i for i in range(len(prompt), end + 1) if i == end or traj.loss_mask[i] == 0)
        sampled_positions += list(range(len(prompt), n))
    assert [i for i, m in enumerate(traj.loss_mask) if m] == sampled_positions
    assert all(lp < 0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m)


def test_tool_call_then_answer(chat):
    traj, engine = run(chat, [CALL, "The answer is 111."])
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0
    assert (traj.num_turns, traj.tool_calls, traj.tool_errors) == (2, 1, 0)
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert traj.messages[3].content == "111"
    assert_invariants(traj, engine, chat)
    # the full trajectory is exactly the template's rendering of the conversation
    tools = Calc().tool_schemas()
    text = chat.decode(traj.token_ids)
    assert text == chat.render(traj.messages[:2], tools, add_generation_prompt=True) + chat.decode(
        traj.token_ids[traj.prompt_len :]
    )
    assert traj.token_ids[-1] == chat.end_of_turn_id


def test_malformed_calls_are_answered_and_counted(chat):
    script = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
        '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
        "111",
    ]
    traj, engine = run(chat, script, max_turns=5)
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0
    assert (traj.tool_calls, traj.tool_errors) == (3, 3)
    tool_msgs = [m.content for m in traj.messages if m.role == "tool"]
    assert "not valid JSON" in tool_msgs[0]
    assert "unknown tool 'abacus'" in tool_msgs[1]
    assert "expression: Field required" in tool_msgs[2]
    assert traj.tool_error_kinds == {"bad_json": 1, "unknown_tool": 1, "invalid_arguments": 1}
    assert_invariants(traj, engine, chat)


def test_tool_error_penalty(chat):
    traj, _ = run(chat, ["<tool_call>{bad</tool_call>", "111"], tool_error_penalty=0.25)
    assert traj.reward == pytest.approx(0.75)


def test_limits_end_the_episode(chat):
    traj, engine = run(chat, [CALL], max_turns=3)
    assert traj.stop_reason == StopReason.MAX_TURNS and traj.num_turns == 3 and traj.reward == 0.0
    assert_invariants(traj, engine, chat)
    traj, _ = run(chat, ["1 " * 100], max_new_tokens=16)
    assert traj.stop_reason == StopReason.MAX_TOKENS and traj.num_sampled == 16
    traj, _ = run(chat, [CALL], max_turns=10, max_tokens=60)
    assert traj.stop_reason == StopReason.MAX_TOKENS
    assert (
        len(traj.token_ids) - traj.prompt_len <= 60 + 20
    )  # the budget is checked before each turn


def test_infrastructure_failures_are_unscorable_not_zero(chat):
    traj, _ = run(chat, lambda ids, i: EngineError("connection refused"))
    assert traj.stop_reason == StopReason.ENGINE_ERROR and math.isnan(traj.reward)
    assert "connection refused" in traj.stop_detail

    class Broken(Calc):
        async def step(self, action):
            raise KeyError("state")

    traj, _ = run(chat, ["111"], env=Broken)
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward)
    assert "step raised KeyError" in traj.stop_detail

    class BrokenReset(Calc):
        def reset(self, *, seed=None, options=None):
            raise OSError("dataset missing")

    traj, _ = run(chat, ["111"], env=BrokenReset)
    assert (
        traj.stop_reason == StopReason.ENV_ERROR
        and math.isnan(traj.reward)
        and traj.token_ids == ()
    )

    class BadReward(Env):
        def step(self, action):
            return [], "1.0", True, False, {}

    traj, _ = run(chat, ["111"], env=BadReward)
    assert (
        traj.stop_reason == StopReason.ENV_ERROR
        and "reward must be a finite number, got '1.0'" in traj.stop_detail
    )


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


def test_env_may_name_its_ending(chat):
    class Strict(Env):
        def step(self, action):
            if not action.content.strip().isdigit():
                return EnvStep([], -1.0, True, False, stop_reason="parse_error")
            return EnvStep([], 1.0, True, False, stop_reason="engine_error")  # not the env's to say

    traj, _ = run(chat, ["four"], env=Strict)
    assert traj.stop_reason == StopReason.PARSE_ERROR and traj.reward == -1.0
    traj, _ = run(chat, ["4"], env=Strict)
    assert (
        traj.stop_reason == StopReason.ENV_ERROR and "an env may choose one of" in traj.stop_detail
    )


def test_group_members_share_task_and_env_seed(chat):
    seeds = []

    class Recording(Calc):
        def reset(self, *, seed=None, options=None):
            seeds.append(seed)
            return super().reset(seed=seed, options=options)

    engine = ScriptedEngine(chat.tokenizer, ["111", "112"], chat.end_of_turn_id)
    g = asyncio.run(run_group(Recording, engine, chat, TASK, 4, SamplingParams(seed=10), seed=7))
    assert seeds == [7] * 4 and len(g.trajectories) == 4
    assert sorted(t.reward for t in g.trajectories) == [0.0, 0.0, 1.0, 1.0]
    assert {t.group_id for t in g.trajectories} == {TASK.id}


def test_collect_runs_groups_concurrently(chat):
    engine = ScriptedEngine(
        chat.tokenizer, by_turn(chat, CALL, "111"), chat.end_of_turn_id, delay_s=0.05
    )
    tasks = Calc.load_tasks("train", seed=0, n=4)
    done = []
    groups = asyncio.run(
        collect(
            Calc,
            engine,
            chat,
            tasks,
            RolloutConfig(group_size=4),
            on_done=lambda t, s: done.append(t),
        )
    )
    assert len(groups) == 4 and len(done) == 16
    assert len({g.group_id for g in groups}) == 4
    assert engine.max_in_flight == 16  # every first turn was in the engine at once, not one by one
    assert all(t.num_turns == 2 for g in groups for t in g.trajectories)


# ---------------------------------------------------------------------------------------------
# Deadlines, bounds, tool limits


class SlowTools(ToolEnv):
    """`wait` sleeps (async); `dump` returns a long text; `hang` sleeps in a thread (sync)."""

    @tool
    async def wait(self, seconds: float) -> str:
        """Sleep, then say done."""
        await asyncio.sleep(seconds)
        return "done"

    @tool
    def dump(self, n: int) -> str:
        """Return n words."""
        return " ".join(f"word{i}" for i in range(n))

    def reward(self, task, messages):
        return 1.0


def _call(name, **args):
    import json

    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(args)}}}</tool_call>'


def test_turn_deadline_keeps_what_was_generated(chat):
    # turn 1 is quick, the engine then stalls on turn 2: TIMEOUT, unscorable, turn 1 kept intact
    traj, engine = run(
        chat,
        [_call("wait", seconds=0), "done"],
        env=SlowTools,
        delay_s=lambda i: 0 if i == 0 else 5.0,
        turn_timeout_s=0.3,
        max_turns=3,
    )
    assert traj.stop_reason == StopReason.TIMEOUT and math.isnan(traj.reward)
    assert traj.deadline == "turn" and "turn 2 exceeded its deadline of 0.3 s" in traj.stop_detail
    assert traj.num_turns == 1 and [m.role for m in traj.messages][-2:] == ["assistant", "tool"]
    assert (
        list(traj.token_ids) == engine.calls[1]
    )  # exactly the sequence the stalled request was sent
    traj.check()


def test_slow_env_step_hits_the_turn_deadline(chat):
    release = threading.Event()

    class SlowStep(Env):
        def step(self, action):  # sync: runs in a worker thread, cannot be killed
            release.wait(5)
            return [], 1.0, True, False, {}

    try:
        traj, engine = run(chat, ["hi"], env=SlowStep, turn_timeout_s=0.1)
        stuck = rollout_metrics([Group("g", TASK, [traj])])["user_threads_stuck"]
    finally:
        release.set()
    assert traj.stop_reason == StopReason.TIMEOUT and traj.deadline == "turn"
    assert (
        traj.num_sampled == len(chat.encode("hi")) + 1
    )  # the sampled turn is kept, nothing after it
    assert_invariants(traj, engine, chat)
    assert stuck >= 1  # the abandoned step still holds its thread, and the metrics say so


def test_episode_deadline(chat):
    traj, engine = run(
        chat, [_call("wait", seconds=0.1)], env=SlowTools, max_turns=50, episode_timeout_s=0.5
    )
    assert traj.stop_reason == StopReason.TIMEOUT and traj.deadline == "episode"
    assert 1 <= traj.num_turns < 50
    assert_invariants(traj, engine, chat)


def test_timeout_raised_by_env_code_is_an_env_error_not_a_deadline(chat):
    class Flaky(Env):
        async def step(self, action):
            raise TimeoutError("upstream API timed out")

    traj, _ = run(chat, ["hi"], env=Flaky, turn_timeout_s=30.0)
    assert traj.stop_reason == StopReason.ENV_ERROR and "upstream API timed out" in traj.stop_detail


def test_tool_deadline_and_call_limit_from_config_are_tool_errors(chat):
    calls = _call("wait", seconds=5) + _call("dump", n=1) + _call("dump", n=2)
    traj, engine = run(
        chat,
        [calls, "done"],
        env=SlowTools,
        tool_timeout_s=0.2,
        max_tool_calls_per_turn=2,
        max_new_tokens=200,
    )
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0  # the episode went on
    assert (
        traj.tool_error_kinds == {"tool_timeout": 1, "too_many_calls": 1} and traj.tool_errors == 2
    )
    outputs = [m.content for m in traj.messages if m.role == "tool"]
    assert (
        "did not finish within 0.2 s" in outputs[0]
        and outputs[1] == "word0"
        and "too many" in outputs[2]
    )
    assert_invariants(traj, engine, chat)


def test_tool_output_is_truncated_to_a_token_budget(chat):
    traj, engine = run(
        chat, [_call("dump", n=500), "done"], env=SlowTools, max_tool_output_tokens=12
    )
    out = next(m.content for m in traj.messages if m.role == "tool")
    assert out.startswith("word0 word1") and "more tokens truncated]" in out
    assert len(chat.encode(out.split("\n[...")[0])) == 12 and traj.tool_outputs_truncated == 1
    assert_invariants(traj, engine, chat)
    assert "word499" not in chat.decode(traj.token_ids)  # the model saw the cut output only


def test_step_deadline_ends_the_stragglers_and_keeps_the_rest(chat):
    engine = ScriptedEngine(chat.tokenizer, ["111"], chat.end_of_turn_id, delay_s=0.4)
    cfg = RolloutConfig(group_size=4, max_concurrent_trajectories=2, step_timeout_s=0.7)
    groups = asyncio.run(collect(Calc, engine, chat, [TASK], cfg))
    reasons = sorted(t.stop_reason.value for t in groups[0].trajectories)
    assert reasons == ["completed", "completed", "timeout", "timeout"]  # 2 in flight, 0.4 s each
    metrics = rollout_metrics(groups)
    assert (
        metrics["timeout/step"] == 2
        and metrics["unscorable"] == 2
        and metrics["stop/completed"] == 2
    )
    scored = [t.reward for t in groups[0].trajectories if not math.isnan(t.reward)]
    assert metrics["reward_mean"] == pytest.approx(sum(scored) / 2)  # the timeouts (NaN) left out
    assert metrics["sampled_tokens"] == sum(t.num_sampled for t in groups[0].trajectories)
    for t in groups[0].trajectories:
        t.check()


def test_in_flight_bounds(chat):
    tasks = Calc.load_tasks("train", seed=0, n=3)
    engine = ScriptedEngine(
        chat.tokenizer, by_turn(chat, CALL, "111"), chat.end_of_turn_id, delay_s=0.02
    )
    asyncio.run(
        collect(Calc, engine, chat, tasks, RolloutConfig(group_size=4, max_concurrent_requests=3))
    )
    assert engine.max_in_flight == 3 and len(engine.calls) == 24
    live, most = 0, 0

    class Counting(Calc):
        def reset(self, *, seed=None, options=None):
            nonlocal live, most
            live += 1
            most = max(most, live)
            return super().reset(seed=seed, options=options)

        def reward(self, task, messages):
            nonlocal live
            live -= 1
            return super().reward(task, messages)

    engine = ScriptedEngine(
        chat.tokenizer, by_turn(chat, CALL, "111"), chat.end_of_turn_id, delay_s=0.02
    )
    groups = asyncio.run(
        collect(
            Counting,
            engine,
            chat,
            tasks,
            RolloutConfig(group_size=4, max_concurrent_trajectories=5),
        )
    )
    assert most == 5 and all(
        t.stop_reason == StopReason.COMPLETED for g in groups for t in g.trajectories
    )


def test_no_lock_step_a_slow_tool_does_not_hold_back_other_trajectories(chat):
    """Member 0's tool waits until member 1 has finished its whole episode. With lock-step turns
    member 1's second turn would wait for member 0's tool, and the tool would time out instead."""
    released = asyncio.Event()
    order = []

    class Blocking(ToolEnv):
        tool_timeout_s = 5.0

        @tool
        async def wait(self, seconds: float) -> str:
            """Wait for the other member (member 0) or not (member 1)."""
            if self.member == 0:
                await released.wait()
                return "released"
            return "quick"

        def reward(self, task, messages):
            order.append(self.member)
            return 1.0

    members = iter(range(2))

    def factory():
        env = Blocking()
        env.member = next(members)
        return env

    def on_done(t, score):
        released.set()

    engine = ScriptedEngine(
        chat.tokenizer,
        lambda ids, i: _call("wait", seconds=0) if i < 2 else "ok",
        chat.end_of_turn_id,
    )
    group = asyncio.run(
        run_group(factory, engine, chat, TASK, 2, SamplingParams(), on_done=on_done)
    )
    assert order == [1, 0]
    assert [m.content for m in group.trajectories[0].messages if m.role == "tool"] == ["released"]


def test_env_factory_failure_ends_one_trajectory(chat):
    made = iter(range(3))

    def factory():
        if next(made) == 1:
            raise RuntimeError("no GPU for the simulator")
        return Calc()

    engine = ScriptedEngine(chat.tokenizer, ["111"], chat.end_of_turn_id)
    g = asyncio.run(run_group(factory, engine, chat, TASK, 3, SamplingParams()))
    assert [t.stop_reason for t in g.trajectories] == [
        StopReason.COMPLETED,
        StopReason.ENV_ERROR,
        StopReason.COMPLETED,
    ]
    assert "no GPU for the simulator" in g.trajectories[1].stop_detail and math.isnan(
        g.trajectories[1].reward
    )


def test_sync_reward_runs_off_the_event_loop(chat):
    """A ToolEnv's sync `reward` (a slow math check, a sandbox call) runs in a worker thread: the
    members of a group are scored at the same time, not one after another on the event loop."""

    class SlowReward(Calc):
        def reward(self, task, messages):
            time.sleep(0.3)
            return super().reward(task, messages)

    engine = ScriptedEngine(chat.tokenizer, ["111"], chat.end_of_turn_id)
    t0 = time.monotonic()
    g = asyncio.run(run_group(SlowReward, engine, chat, TASK, 6, SamplingParams()))
    assert [t.reward for t in g.trajectories] == [1.0] * 6
    assert time.monotonic() - t0 < 1.0  # 6 x 0.3 s = 1.8 s if each reward blocked the loop in turn


class Diagnosed(Calc):
    """Ends with diagnostics in its info: the rollout keeps them, as JSON, in the trajectory."""

    async def step(self, action):
        new, reward, terminated, truncated, info = await super().step(action)
        if terminated:
            info = {**info, "expected": 111, "why": "off by one", "raw": object()}
        return new, reward, terminated, truncated, info


def test_the_final_steps_own_info_reaches_the_trajectory(chat):
    traj, _ = run(chat, ["112"], env=Diagnosed)
    env_info = traj.env_info
    assert (env_info["expected"], env_info["why"]) == (111, "off by one")
    assert env_info["raw"].startswith("<object object")  # not JSON: kept as its str
    assert "tool_errors" not in env_info and "stop_reason" not in env_info  # the rollout's own keys
    json.dumps(traj.to_dict(), allow_nan=False)  # trajectories.jsonl can hold it


# ---------------------------------------------------------------------------------------------
# Seeds, bad values from user code, engine failures


class Chatty(Env):
    """Never ends on its own: every turn gets a user reply."""

    def step(self, action):
        return [Message(role="user", content="go on")], 0.0, False, False, {}


class SeedSpy(ScriptedEngine):
    """Records the sampling seed of every request, by the member (first-turn seed) asking."""

    def __init__(self, chat):
        super().__init__(chat.tokenizer, ["hi"], chat.end_of_turn_id)
        self.seeds = []

    async def generate(self, prompt_ids, params):
        self.seeds.append(params.seed)
        return await super().generate(prompt_ids, params)


def test_every_turn_gets_its_own_sampling_seed(chat):
    """Engines seed a fresh generator per request: one seed for all turns would restart the same
    random stream each turn (turn k a copy of turn 1 under a flat policy)."""

    def seeds_of_a_group():
        engine = SeedSpy(chat)
        asyncio.run(
            run_group(
                Chatty,
                engine,
                chat,
                TASK,
                3,
                SamplingParams(max_new_tokens=8, seed=1234),
                seed=0,
                limits=EpisodeLimits(max_turns=4),
            )
        )
        return engine.seeds

    seeds = seeds_of_a_group()
    assert len(seeds) == 12 and len(set(seeds)) == 12  # 3 members x 4 turns, all distinct
    assert {1234, 1235, 1236} <= set(
        seeds
    )  # turn 1: params.seed + member, as for single-turn episodes
    assert all(0 <= s < 2**63 for s in seeds)  # fits SGLang's int64 sampling_seed
    assert seeds_of_a_group() == seeds  # reproducible: the same seed gives the same turn seeds
    # the mix is fixed (SplitMix64 of (seed, turn)), not Python's per-process salted hash()
    from agentgrpo.rollout.seeds import episode_seed

    assert episode_seed(1234) == 1234 and episode_seed(None, turn=3) is None
    assert episode_seed(1234, turn=2) == 5468443737350222482
    assert episode_seed(1234, member=2, turn=3) == episode_seed(1236, turn=3)


def test_a_group_s_seeds_follow_from_the_run_seed_and_its_draw(chat):
    """One rule (`episode_seed`) for training, evaluation and the rollout: group d of a run with
    seed s resets every member's env with episode_seed(s, draw=d), and member i samples turn 1 with
    that + i; the same draw gives the same seeds whatever else the step holds."""
    from agentgrpo.rollout.seeds import episode_seed

    resets = []

    class Recorded(Calc):
        def reset(self, *, seed=None, options=None):
            resets.append(seed)
            return super().reset(seed=seed, options=options)

    def sampled(draws):
        engine, resets[:] = SeedSpy(chat), []
        cfg = RolloutConfig(group_size=2, max_turns=1)
        groups = asyncio.run(
            collect(Recorded, engine, chat, [TASK] * len(draws), cfg, seed=5, draws=draws)
        )
        return groups, sorted(engine.seeds), sorted(resets)

    groups, seeds, envs = sampled([7, 9])
    g7, g9 = episode_seed(5, draw=7), episode_seed(5, draw=9)
    assert envs == sorted([g7, g7, g9, g9]) and seeds == sorted([g7, g7 + 1, g9, g9 + 1])
    assert [g.group_id for g in groups] == [f"7:{TASK.id}", f"9:{TASK.id}"]
    assert sampled([9])[1] == sorted([g9, g9 + 1])  # a group's seeds are its draw's alone
    with pytest.raises(ValueError, match="1 tasks but 2 draws"):
        asyncio.run(collect(Recorded, SeedSpy(chat), chat, [TASK], RolloutConfig(), draws=[1, 2]))


def test_only_an_episode_runner_runs_its_own_episode(chat):
    """The rollout hands an env its episode only when it inherits EpisodeRunner (an AgentEnv); a
    method of the same name alone is not a declaration, and an incomplete runner cannot be made."""
    from agentgrpo import AgentEnv
    from agentgrpo.env.runner import EpisodeRunner

    class LooksLikeOne(Calc):
        async def run_own_episode(self, *args, **kwargs):
            raise AssertionError("a plain env's episode is the rollout's")

    traj, _ = run(chat, [CALL, "111"], env=LooksLikeOne)
    assert traj.stop_reason == StopReason.COMPLETED and traj.num_turns == 2
    group = asyncio.run(
        run_group(
            LooksLikeOne,
            ScriptedEngine(chat.tokenizer, by_turn(chat, CALL, "111"), chat.end_of_turn_id),
            chat,
            TASK,
            1,
            SamplingParams(),
        )
    )
    assert group.trajectories[0].stop_reason == StopReason.COMPLETED
    assert issubclass(AgentEnv, EpisodeRunner) and not issubclass(Calc, EpisodeRunner)

    class Incomplete(Env, EpisodeRunner):
        pass

    with pytest.raises(TypeError, match="run_own_episode"):
        Incomplete()


def test_a_group_without_a_seed_still_shares_one_start_state(chat):
    class Dice(Env):
        def reset(self, *, seed=None, options=None):
            msgs, info = super().reset(seed=seed, options=options)
            self.target = int(self.np_random.integers(1_000_000))
            return [Message(role="user", content=f"guess {self.target}")], info

        def step(self, action):
            return [], 0.0, True, False, {"target": self.target}

    engine = ScriptedEngine(chat.tokenizer, ["7"], chat.end_of_turn_id)
    starts = [
        [
            t.env_info["target"]
            for t in asyncio.run(
                run_group(Dice, engine, chat, TASK, 6, SamplingParams())
            ).trajectories
        ]
        for _ in range(2)
    ]
    assert all(len(set(s)) == 1 for s in starts)  # one state per group
    assert starts[0][0] != starts[1][0]  # drawn per group (a 1-in-a-million coincidence otherwise)


class DictObs(Env):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed, options=options)
        return [{"role": "user", "content": "hi"}], {}

    def step(self, action):
        return [], 1.0, True, False, {}


@pytest.mark.parametrize(
    "reset_returns, why",
    [
        (
            lambda env: ([{"role": "user", "content": "hi"}], {}),
            "reset's messages must be a non-empty list of Message",
        ),
        (lambda env: ("hi", {}), "reset's messages must be a non-empty list of Message, got 'hi'"),
        (lambda env: ([], {}), "reset's messages must be a non-empty list of Message, got []"),
        (lambda env: env.task.prompt_messages(), "reset must return (messages, info)"),
        (
            lambda env: (env.task.prompt_messages(), None),
            "reset's info must be a dict, got NoneType",
        ),
    ],
)
def test_bad_reset_values_end_the_trajectory_with_env_error(chat, reset_returns, why):
    class Bad(Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed, options=options)
            return reset_returns(self)

        def step(self, action):
            return [], 1.0, True, False, {}

    traj, engine = run(chat, ["7"], env=Bad)
    assert (
        traj.stop_reason == StopReason.ENV_ERROR
        and why in traj.stop_detail
        and math.isnan(traj.reward)
    )
    assert traj.token_ids == () and engine.calls == []


@pytest.mark.parametrize(
    "errors, why",
    [
        ({"bad_json": "n/a"}, "tool_errors must count with non-negative ints"),
        ({"bad_json": -1}, "tool_errors must count with non-negative ints"),
        ({"x": 1}, "'x' is not a valid ToolErrorKind"),
    ],
)
def test_bad_typed_step_fields_end_the_trajectory_with_env_error(chat, errors, why):
    class Bad(Env):
        def step(self, action):
            return EnvStep(
                [Message(role="user", content="more")], 0.0, False, False, tool_errors=errors
            )

    traj, _ = run(chat, ["7"], env=Bad)
    assert traj.stop_reason == StopReason.ENV_ERROR and why in traj.stop_detail


def test_final_info_that_is_not_json_is_an_env_error(chat):
    loop = {}
    loop["self"] = loop

    class Circular(Env):
        def step(self, action):
            return [], 1.0, True, False, {"state": loop}

    traj, _ = run(chat, ["7"], env=Circular)
    assert (
        traj.stop_reason == StopReason.ENV_ERROR
        and "info cannot be kept as JSON" in traj.stop_detail
    )
    assert "Circular reference" in traj.stop_detail


def test_bad_env_values_do_not_crash_the_step(chat):
    engine = ScriptedEngine(chat.tokenizer, ["7"], chat.end_of_turn_id)
    groups = asyncio.run(collect(DictObs, engine, chat, [TASK, TASK], RolloutConfig(group_size=2)))
    assert [t.stop_reason for g in groups for t in g.trajectories] == [StopReason.ENV_ERROR] * 4


def test_numpy_rewards_are_numbers(chat):
    import numpy as np

    class Numpy(Env):
        def step(self, action):
            return [], np.float32(0.5), np.bool_(True), False, {}

    traj, _ = run(chat, ["7"], env=Numpy)
    assert (
        traj.stop_reason == StopReason.COMPLETED
        and traj.reward == 0.5
        and type(traj.reward) is float
    )

    class NumpyNaN(Env):
        def step(self, action):
            return [], np.float32("nan"), True, False, {}

    traj, _ = run(chat, ["7"], env=NumpyNaN)
    assert (
        traj.stop_reason == StopReason.ENV_ERROR
        and "reward must be a finite number" in traj.stop_detail
    )


@pytest.mark.parametrize(
    "exc", [TimeoutError("read timed out"), RuntimeError("CUDA error: device-side assert")]
)
def test_any_engine_exception_is_an_engine_error_that_keeps_the_turns(chat, exc):
    """Not only EngineError: a builtin TimeoutError from a client library is the engine's failure,
    not a step deadline before the episode started, and any other exception ends one trajectory."""
    script = lambda ids, i: CALL if chat.decode(ids).count("<|im_start|>assistant") == 1 else exc  # noqa: E731
    engine = ScriptedEngine(chat.tokenizer, script, chat.end_of_turn_id)
    g = asyncio.run(
        run_group(
            Calc,
            engine,
            chat,
            TASK,
            2,
            SamplingParams(),
            seed=0,
            limits=EpisodeLimits(episode_timeout_s=600),
        )
    )
    for traj in g.trajectories:
        assert traj.stop_reason == StopReason.ENGINE_ERROR and math.isnan(traj.reward)
        assert type(exc).__name__ in traj.stop_detail and str(exc) in traj.stop_detail
        assert (
            traj.num_turns == 1 and traj.messages[-1].role == "tool"
        )  # turn 1 and its tool output kept
        assert "deadline" not in traj.info
        traj.check()
    # through collect's slot wait too: only the wait for a slot is a step-deadline timeout
    engine = ScriptedEngine(chat.tokenizer, script, chat.end_of_turn_id)
    cfg = RolloutConfig(group_size=2, max_concurrent_trajectories=1, step_timeout_s=60)
    groups = asyncio.run(collect(Calc, engine, chat, [TASK], cfg))
    assert [t.stop_reason for t in groups[0].trajectories] == [StopReason.ENGINE_ERROR] * 2


def test_only_the_slot_wait_is_timed_as_the_step_deadline(chat, monkeypatch):
    """run_group's step-deadline handler covers the wait for an episode slot only: a TimeoutError
    from inside an episode (run_episode ends every failure it knows as a trajectory) is a bug to
    surface, not 'step deadline expired before the episode started'."""
    import agentgrpo.rollout.group as rollout

    async def broken(*args, **kwargs):
        raise TimeoutError("a bug inside the episode")

    monkeypatch.setattr(rollout, "run_episode", broken)
    with pytest.raises(TimeoutError, match="a bug inside the episode"):
        asyncio.run(
            run_group(
                Calc,
                ScriptedEngine(chat.tokenizer, ["111"], chat.end_of_turn_id),
                chat,
                TASK,
                2,
                SamplingParams(),
                slots=asyncio.Semaphore(1),
                deadline=time.monotonic() + 60,
            )
        )


def test_cancellation_is_not_an_engine_error(chat):
    class Cancelled(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            raise asyncio.CancelledError

    engine = Cancelled(chat.tokenizer, [], chat.end_of_turn_id)
    with pytest.raises(asyncio.CancelledError):  # a cancelled collection stops; it is not recorded
        asyncio.run(run_episode(Calc(), engine, chat, TASK, SamplingParams()))


def test_a_call_cut_by_the_token_limit_is_a_counted_error(chat):
    """parse_hermes reports an unclosed call at the token limit: the rollout counts and penalises
    it, and records the text the model wrote, though the cut turn ends the episode."""
    traj, _ = run(chat, [CALL], max_new_tokens=12, tool_error_penalty=0.5)
    assert traj.stop_reason == StopReason.MAX_TOKENS
    assert (traj.tool_calls, traj.tool_errors, traj.tool_error_kinds) == (1, 1, {"unclosed": 1})
    assert traj.reward == pytest.approx(-0.5)
    sampled = chat.decode(traj.token_ids[traj.prompt_len :])
    assert sampled.startswith("<tool_call>") and traj.messages[-1].role == "assistant"
    assert traj.messages[-1].content == sampled.strip() and not traj.messages[-1].tool_calls


@pytest.fixture(scope="module")
def llama_chat(smol_tokenizer):
    from tests.conftest import llama31_chat

    return llama31_chat(smol_tokenizer)


def test_parallel_calls_under_a_single_call_template_are_tool_errors(llama_chat):
    """Llama 3.1's template refuses two calls in one turn. With max_tool_calls_per_turn=1 (the
    audit's advice) the extra call is answered with an error and the episode goes on: the rendered
    history holds only the calls the env ran, while the tokens stay the ones sampled."""
    two = (
        '{"name": "calculator", "parameters": {"expression": "56+55"}}; '
        '{"name": "calculator", "parameters": {"expression": "1+1"}}'
    )
    traj, engine = run(llama_chat, [two, "111"], max_tool_calls_per_turn=1)
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0
    assert traj.tool_error_kinds == {"too_many_calls": 1} and (
        traj.tool_calls,
        traj.tool_errors,
    ) == (2, 1)
    assert len(traj.messages[2].tool_calls) == 2  # the record keeps what the model asked for
    assert [m.content for m in traj.messages if m.role == "tool"][0] == "111"
    assert list(traj.token_ids[: len(engine.calls[1])]) == engine.calls[1]
    assert llama_chat.decode(engine.calls[1]).count("56+55") == 1 and "1+1" in llama_chat.decode(
        engine.calls[1]
    )
    traj.check()
    # without the limit the template cannot show the turn: unscorable, and the detail says why
    traj, _ = run(llama_chat, [two, "111"])
    assert (
        traj.stop_reason == StopReason.ENV_ERROR
        and "only supports single tool-calls" in traj.stop_detail
    )


def test_json_the_decoder_cannot_take_is_an_event_and_the_episode_goes_on(chat):
    # a 5000-digit integer made json raise ValueError (not JSONDecodeError) out of run_episode,
    # and asyncio.gather then took the whole step down
    huge = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": '
        + "9" * 5000
        + "}}</tool_call>"
    )
    traj, engine = run(chat, [huge, CALL, "111"], max_new_tokens=8000, max_tokens=16000)
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0
    assert traj.tool_error_kinds == {"bad_json": 1}
    assert_invariants(traj, engine, chat)


def test_a_parser_that_raises_leaves_one_episode_unscorable_not_the_step_dead(chat, monkeypatch):
    def broken(*a, **k):
        raise KeyError("a user parser's bug")

    monkeypatch.setattr(chat, "parse_assistant", broken)
    traj, _ = run(chat, [CALL])
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward)
    assert "the tool-call parser raised KeyError" in traj.stop_detail


# ---------------------------------------------------------------------------------------------
# Every episode's env is closed, once, whatever ended it


class Closing(Calc):
    """Records its closes; `mode` picks how its step behaves."""

    closed: list[int] = []
    opened: list[int] = []
    mode = "answer"

    def reset(self, *, seed=None, options=None):
        Closing.opened.append(id(self))
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self.mode == "raise":
            raise RuntimeError("env bug")
        if self.mode == "parse_error":
            return EnvStep([], 0.0, True, False, stop_reason=StopReason.PARSE_ERROR)
        if self.mode == "tool_error":
            return EnvStep([], 0.0, True, False, stop_reason=StopReason.TOOL_ERROR)
        if self.mode == "truncated":
            return EnvStep([], 0.0, False, True)
        return super().step(action)

    def close(self):
        Closing.closed.append(id(self))


class AbortingEngine(ScriptedEngine):
    """Answers every request as aborted (a weight update or a shutdown, on a real server)."""

    async def generate(self, prompt_ids, params):
        out = await super().generate(prompt_ids, params)
        return Completion(
            token_ids=out.token_ids[:1],
            logprobs=out.logprobs[:1],
            finish_reason="abort",
            weight_version=out.weight_version,
        )


class AsyncClosing(Closing):
    async def close(self):
        await asyncio.sleep(0)
        Closing.closed.append(id(self))


@pytest.mark.parametrize("env_cls", [Closing, AsyncClosing])
@pytest.mark.parametrize(
    "case, reason",
    [
        ("answer", StopReason.COMPLETED),
        ("max_turns", StopReason.MAX_TURNS),
        ("max_tokens", StopReason.MAX_TOKENS),
        ("raise", StopReason.ENV_ERROR),
        ("parse_error", StopReason.PARSE_ERROR),
        ("tool_error", StopReason.TOOL_ERROR),
        ("truncated", StopReason.TRUNCATED),
        ("engine", StopReason.ENGINE_ERROR),
        ("aborted", StopReason.ABORTED),
        ("timeout", StopReason.TIMEOUT),
    ],
)
def test_every_episode_closes_its_env_once(chat, env_cls, case, reason):
    script = {"max_turns": [CALL], "max_tokens": ["word " * 90]}.get(case, ["The answer is 111."])
    engine_cls = {"engine": FailingEngine, "aborted": AbortingEngine}.get(case, ScriptedEngine)
    engine = engine_cls(
        chat.tokenizer, script, chat.end_of_turn_id, delay_s=0.5 if case == "timeout" else 0.0
    )
    limits = EpisodeLimits(max_turns=1, turn_timeout_s=0.1 if case == "timeout" else None)
    made: list[int] = []

    def factory():
        env = env_cls()
        env.mode = case
        made.append(id(env))
        return env

    Closing.closed = []
    group = asyncio.run(
        run_group(
            factory, engine, chat, TASK, 3, SamplingParams(max_new_tokens=64), seed=0, limits=limits
        )
    )
    assert [t.stop_reason for t in group.trajectories] == [reason] * 3
    assert sorted(Closing.closed) == sorted(made) and len(made) == 3  # each env once


def test_a_cancelled_episode_still_closes_its_env(chat):
    engine = ScriptedEngine(
        chat.tokenizer, ["The answer is 111."], chat.end_of_turn_id, delay_s=5.0
    )
    Closing.closed, Closing.opened = [], []

    async def main():
        task = asyncio.ensure_future(
            run_group(Closing, engine, chat, TASK, 2, SamplingParams(), seed=0)
        )
        for _ in range(1000):  # both episodes under way (a loaded machine took more than 0.2 s)
            if len(Closing.opened) == 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # and waiting on the engine (5 s a turn)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(Closing.closed) == 2


def test_a_close_that_fails_is_noted_and_the_outcome_stands(chat):
    class BadClose(Calc):
        def close(self):
            raise OSError("socket already gone")

    traj = asyncio.run(
        run_group(
            BadClose,
            ScriptedEngine(chat.tokenizer, ["The answer is 111."], chat.end_of_turn_id),
            chat,
            TASK,
            1,
            SamplingParams(),
            seed=0,
        )
    ).trajectories[0]
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0
    assert "close raised OSError: socket already gone" in traj.stop_detail


def test_every_sampled_token_keeps_the_weight_version_that_sampled_it(chat):
    """A turn that ran across a weight update (version_runs) and turns of one version each: the
    trajectory holds one (count, version) run per stretch, summing to the sampled tokens; a
    version the engine does not number is -1."""

    class Swapping(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            out = await super().generate(prompt_ids, params)
            if len(self.calls) == 1:  # the first turn: its first 3 ids from v4, the rest from v5
                out.version_runs = [(3, "4"), (len(out.token_ids) - 3, "5")]
                out.weight_version = "5"
            else:
                out.weight_version = "next"
            return out

    engine = Swapping(chat.tokenizer, by_turn(chat, CALL, "111"), chat.end_of_turn_id)
    traj = asyncio.run(
        run_episode(Calc(), engine, chat, TASK, SamplingParams(), limits=EpisodeLimits())
    )
    first = sum(traj.loss_mask) - len(chat.tokenizer.encode("111")) - 1
    assert traj.token_versions == ((3, 4), (first - 3, 5), (traj.num_sampled - first, -1))
    assert traj.weight_versions == (4, 5)
    assert traj.to_dict()["token_versions"] == [
        [3, 4],
        [first - 3, 5],
        [traj.num_sampled - first, -1],
    ]


def test_version_runs_must_cover_the_completion():
    with pytest.raises(ValueError, match="cover 2 ids, the completion has 3"):
        Completion([1, 2, 3], [-0.1] * 3, "stop", "1", version_runs=[(2, "1")])
    assert Completion([1, 2], [-0.1] * 2, "stop", "7").token_version_runs == [(2, "7")]


def test_every_turn_of_an_episode_carries_its_session_id(chat):
    sessions = []

    class Recording(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            sessions.append(
                (chat.decode(prompt_ids).count("<|im_start|>assistant"), params.session_id)
            )
            return await super().generate(prompt_ids, params)

    engine = Recording(chat.tokenizer, by_turn(chat, CALL, "111"), chat.end_of_turn_id)
    asyncio.run(
        run_group(Calc, engine, chat, TASK, 3, SamplingParams(seed=1), seed=7, group_id="g")
    )
    assert sorted(sessions) == sorted((turn, f"g/{i}") for i in range(3) for turn in (1, 2))
