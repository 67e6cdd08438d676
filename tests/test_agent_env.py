"""AgentEnv: agent code written against the OpenAI client, recorded token-exactly through the
policy endpoint, with a scripted engine and the real SmolLM2 tokenizer."""

import asyncio
import math

import pytest

pytest.importorskip("openai")

from agentgrpo import AgentEnv, StopReason  # noqa: E402
from agentgrpo.engine import SamplingParams  # noqa: E402
from agentgrpo.env.rubric import Rubric  # noqa: E402
from agentgrpo.rollout.episode import EpisodeLimits, RolloutConfig, collect, run_group  # noqa: E402
from examples.openai_agent import CalculatorAgent  # noqa: E402
from tests.fakes import ScriptedEngine  # noqa: E402

TASK = CalculatorAgent.load_tasks("train", seed=0, n=1)[0]  # "What is 56 + 55?" -> 111
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "56+55"}}\n</tool_call>'


class Calc(CalculatorAgent):
    """Without the worked example: by_turn counts assistant turns."""

    def __init__(self) -> None:
        super().__init__(demo=False)


def by_turn(chat, *texts):
    return lambda ids, i: texts[
        min(chat.decode(ids).count("<|im_start|>assistant") - 1, len(texts) - 1)
    ]


def group(
    chat, script, env=Calc, n=1, limits=EpisodeLimits(max_turns=4, max_tokens=512), task=TASK
):
    engine = ScriptedEngine(chat.tokenizer, script, chat.end_of_turn_id)
    g = asyncio.run(
        run_group(
            env,
            engine,
            chat,
            task,
            n,
            SamplingParams(max_new_tokens=64, seed=3),
            seed=0,
            limits=limits,
        )
    )
    return g.trajectories, engine


def assert_token_exact(traj, engine):
    """Mask 1 exactly on what the engine sampled, with its logprobs; every prompt the engine got
    is a prefix of the trajectory."""
    traj.check()
    for prompt in engine.calls:
        assert list(traj.token_ids[: len(prompt)]) == prompt
    spans = [(len(p), len(p) + n) for p, n in zip(engine.calls, engine.sampled_lengths)]
    assert [i for i, m in enumerate(traj.loss_mask) if m] == [
        i for a, b in spans for i in range(a, b)
    ]


@pytest.fixture(autouse=True)
def _record_sampled(monkeypatch):
    """ScriptedEngine keeps the prompts; also keep how many ids each call sampled."""
    real = ScriptedEngine.generate

    async def generate(self, prompt_ids, params):
        out = await real(self, prompt_ids, params)
        self.__dict__.setdefault("sampled_lengths", []).append(len(out.token_ids))
        self.__dict__.setdefault("sampled", []).append((out.token_ids, out.logprobs))
        return out

    monkeypatch.setattr(ScriptedEngine, "generate", generate)


def test_agent_calls_tool_and_answers_token_exact(chat):
    [traj], engine = group(chat, by_turn(chat, CALL, "The answer is 111."))
    assert traj.stop_reason == StopReason.COMPLETED, traj.stop_detail
    assert traj.reward == 1.0 and traj.num_turns == 2 and traj.tool_calls == 1
    assert [m.role for m in traj.messages][-3:] == ["assistant", "tool", "assistant"]
    assert traj.messages[-2].content == "111"
    assert_token_exact(traj, engine)
    sampled = [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m]
    assert sampled == [lp for _, lps in engine.sampled for lp in lps]
    assert list(traj.token_ids[: traj.prompt_len]) == engine.calls[0]


def test_replies_sent_back_are_never_re_tokenized(chat, monkeypatch):
    """Only the first call is rendered from scratch; later ones continue the recorded ids with the
    suffix of the new messages (the text of the model's own turn is never encoded again)."""
    from agentgrpo.chat.format import ChatFormat

    rendered = []
    real = ChatFormat.prompt_ids
    monkeypatch.setattr(
        ChatFormat, "prompt_ids", lambda self, *a, **k: rendered.append(1) or real(self, *a, **k)
    )
    [traj], engine = group(chat, by_turn(chat, CALL, CALL, "111"))
    assert traj.num_turns == 3 and len(rendered) == 1
    assert_token_exact(traj, engine)


def test_malformed_call_is_content_and_counted(chat):
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>'
    [traj], engine = group(chat, by_turn(chat, bad, "111"))
    assert traj.stop_reason == StopReason.COMPLETED and traj.tool_errors == 1
    assert traj.tool_error_kinds == {"bad_json": 1}
    # the malformed call came back as plain content, so the agent took it as its answer
    assert traj.messages[-1].content == bad.strip() and traj.num_turns == 1 and traj.reward == 0.0
    assert_token_exact(traj, engine)


class Rewriter(AgentEnv):
    """Sends a second call whose history is not the first call's: the prompt diverges."""

    async def run(self, client, task):
        first = [{"role": "user", "content": "What is 1 + 1?"}]
        await client.chat.completions.create(model=self.model, messages=first)
        other = [{"role": "user", "content": "Something else entirely"}]
        await client.chat.completions.create(model=self.model, messages=other)
        return 1.0


def test_divergent_prompt_is_a_typed_env_error(chat):
    [traj], _ = group(chat, ["2", "ok"], env=Rewriter)
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward)
    assert "call 2's prompt does not extend call 1's" in traj.stop_detail
    traj.check()
    assert traj.num_turns == 1  # the sequence up to the last call that extends
    assert "trajectory_mode=auto" in traj.stop_detail


@pytest.mark.parametrize("mode", ["auto", "stepwise"])
def test_a_divergent_prompt_opens_a_segment_unless_the_mode_is_single(smol_tokenizer, mode):
    """As in the rollout: the call whose prompt does not extend the sequence (here: the agent
    starts another conversation) begins a new segment, its prompt the call's own; "stepwise" makes
    every call a segment, each prompt rendered from the request's messages."""
    from agentgrpo.chat.format import ChatFormat

    chat = ChatFormat(smol_tokenizer, trajectory_mode=mode)
    [traj], engine = group(chat, ["2", "ok"], env=Rewriter)
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0, traj.stop_detail
    assert traj.num_turns == 2 and len(traj.segments) == 2
    traj.check()
    for seg, prompt, (sampled, logprobs) in zip(
        traj.segments, engine.calls, engine.sampled, strict=True
    ):
        assert list(seg.token_ids) == prompt + sampled and seg.prompt_len == len(prompt)
        assert list(seg.logprobs[seg.prompt_len :]) == logprobs and all(
            seg.loss_mask[seg.prompt_len :]
        )
    [traj], engine = group(chat, by_turn(chat, CALL, "The answer is 111."))
    assert traj.stop_reason == StopReason.COMPLETED and traj.num_turns == 2
    assert len(traj.segments) == {"auto": 1, "stepwise": 2}[mode]
    traj.check()
    if mode == "stepwise":  # the second prompt is the template's render of the whole history
        from examples.openai_agent import TOOLS

        assert engine.calls[1] == chat.prompt_ids(traj.messages[:-1], TOOLS)


class Loops(AgentEnv):
    async def run(self, client, task):
        messages = [{"role": "user", "content": "count"}]
        while True:  # never stops by itself: the turn limit ends it
            reply = await client.chat.completions.create(model=self.model, messages=messages)
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "more"},
            ]


def test_turn_limit_ends_the_episode(chat):
    [traj], engine = group(chat, ["1"], env=Loops, limits=EpisodeLimits(max_turns=3))
    assert traj.stop_reason == StopReason.MAX_TURNS and traj.num_turns == 3 and traj.reward == 0.0
    assert_token_exact(traj, engine)


class Raises(AgentEnv):
    async def run(self, client, task):
        raise RuntimeError("agent bug")


class BadReset(Raises):
    def reset(self, *, seed=None, options=None):
        raise KeyError("no data")


class Slow(AgentEnv):
    async def run(self, client, task):
        await client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "x"}]
        )
        await asyncio.sleep(10)


class ReturnsNone(AgentEnv):
    async def run(self, client, task):
        await client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "x"}]
        )


def test_failures_are_typed(chat):
    [traj], _ = group(chat, ["1"], env=Raises)
    assert traj.stop_reason == StopReason.ENV_ERROR and "agent bug" in traj.stop_detail
    assert math.isnan(traj.reward)
    [traj], _ = group(chat, ["1"], env=BadReset)
    assert traj.stop_reason == StopReason.ENV_ERROR and traj.stop_detail.startswith(
        "reset raised KeyError"
    )
    [traj], _ = group(chat, ["1"], env=Slow, limits=EpisodeLimits(episode_timeout_s=0.5))
    assert traj.stop_reason == StopReason.TIMEOUT and traj.deadline == "episode"
    assert math.isnan(traj.reward) and traj.num_turns == 1
    [traj], _ = group(chat, [RuntimeError("server down")], env=ReturnsNone)
    assert traj.stop_reason == StopReason.ENGINE_ERROR and "server down" in traj.stop_detail
    [traj], _ = group(chat, ["1"], env=ReturnsNone)
    assert traj.stop_reason == StopReason.ENV_ERROR and "no rubric" in traj.stop_detail


def test_a_generation_past_the_turn_deadline_is_cut(chat):
    engine = ScriptedEngine(chat.tokenizer, ["1"], chat.end_of_turn_id, delay_s=5.0)
    g = asyncio.run(
        run_group(
            ReturnsNone,
            engine,
            chat,
            TASK,
            1,
            SamplingParams(max_new_tokens=8),
            limits=EpisodeLimits(turn_timeout_s=0.3),
        )
    )
    [traj] = g.trajectories
    assert traj.stop_reason == StopReason.TIMEOUT and traj.deadline == "turn", traj.stop_detail
    assert "turn 1 exceeded" in traj.stop_detail and math.isnan(traj.reward)


class Scored(ReturnsNone):
    rubric = Rubric([("quarter", lambda traj, task: 0.25, 1.0)])


def test_none_leaves_the_reward_to_the_rubric(chat):
    g = asyncio.run(
        run_group(
            Scored,
            ScriptedEngine(chat.tokenizer, ["1"], chat.end_of_turn_id),
            chat,
            TASK,
            1,
            SamplingParams(max_new_tokens=64),
            seed=0,
        )
    )
    [traj] = g.trajectories
    assert traj.stop_reason == StopReason.COMPLETED and g.rewards == [0.25]
    assert traj.reward == 0.0 and g.score(traj).env_reward == 0.0  # run gave none: the rubric did


class Closes(Calc):
    closed = 0

    def close(self):
        Closes.closed += 1


def test_collect_groups_seeds_and_close(chat):
    """AgentEnv classes go through collect like any env: groups, per-member seeds, one close
    each."""
    engine = ScriptedEngine(chat.tokenizer, by_turn(chat, CALL, "111"), chat.end_of_turn_id)
    cfg = RolloutConfig(group_size=4, tasks_per_step=2, max_turns=3, max_new_tokens=64)
    groups = asyncio.run(
        collect(Closes, engine, chat, CalculatorAgent.load_tasks("train", n=2), cfg)
    )
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 8 and Closes.closed == 8
    assert all(t.stop_reason == StopReason.COMPLETED and t.num_turns == 2 for t in trajs)
    assert [t.reward for t in groups[0].trajectories] == [1.0] * 4  # 56 + 55 is task 0's sum
    assert len({t.group_id for t in trajs}) == 2
    for t in trajs:
        t.check()


class Recording:
    """The local engine, keeping what each request got and sampled."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    async def generate(self, prompt_ids, params):
        out = await self.engine.generate(prompt_ids, params)
        self.seen.append((list(prompt_ids), list(out.token_ids), list(out.logprobs)))
        return out

    async def update_weights(self, weights, *, version):
        await self.engine.update_weights(weights, version=version)


def test_sampled_ids_are_the_local_engines(chat, stopping_model_dir):
    """The real local engine behind the endpoint: every trajectory's masked ids and logprobs are
    exactly what the engine returned for the requests that trajectory made."""
    from agentgrpo.engine.local.engine import LocalEngine

    engine = Recording(LocalEngine(stopping_model_dir, tokenizer=chat.tokenizer, seed=0))
    cfg = RolloutConfig(
        group_size=4, tasks_per_step=2, max_turns=3, max_new_tokens=24, max_tokens=96
    )
    groups = asyncio.run(
        collect(CalculatorAgent, engine, chat, CalculatorAgent.load_tasks("train", n=2), cfg)
    )
    by_prompt = {}  # the members of a group send the same first prompt (with their own seeds)
    for p, ids, lps in engine.seen:
        by_prompt.setdefault(tuple(p), []).append((ids, lps))
    for t in (t for g in groups for t in g.trajectories):
        t.check()
        assert t.stop_reason in (
            StopReason.COMPLETED,
            StopReason.MAX_TURNS,
            StopReason.MAX_TOKENS,
        ), t.stop_detail
        masked = [i for i, m in enumerate(t.loss_mask) if m]
        starts = [i for i in masked if i == 0 or not t.loss_mask[i - 1]]
        assert len(starts) == t.num_turns >= 1
        for s in starts:  # each sampled span is one engine reply to exactly the ids before it
            end = next(
                (i for i in range(s, len(t.loss_mask)) if not t.loss_mask[i]), len(t.loss_mask)
            )
            assert (list(t.token_ids[s:end]), list(t.logprobs[s:end])) in by_prompt[
                tuple(t.token_ids[:s])
            ]


def test_an_openai_agents_sdk_agent_trains_token_exact(chat):
    # optional; on the dependency floors (pydantic 2.6) the Agents SDK does not import
    pytest.importorskip("agents", exc_type=ImportError)
    from examples.openai_agents_sdk import CalculatorSDKAgent

    [traj], engine = group(chat, by_turn(chat, CALL, "The answer is 111."), env=CalculatorSDKAgent)
    assert traj.stop_reason == StopReason.COMPLETED, traj.stop_detail
    assert traj.reward == 1.0 and traj.num_turns == 2 and traj.tool_calls == 1
    assert traj.messages[-2].role == "tool" and traj.messages[-2].content == "111"
    assert_token_exact(traj, engine)
