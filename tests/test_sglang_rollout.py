"""A multi-turn tool episode through SGLangEngine (over real HTTP to the protocol-faithful fake
server) gives exactly the trajectory the same scripted engine gives in-process."""

import asyncio
import dataclasses

from agentgrpo.engine import SamplingParams, SGLangEngine
from agentgrpo.rollout.episode import EpisodeLimits, run_episode, run_group
from agentgrpo.rollout.seeds import episode_seed
from envs.calculator import CalculatorEnv
from tests.fake_sglang import FakeSGLang
from tests.fakes import ScriptedEngine

SCRIPT = [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "56+55"}}\n</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expr": 1}}</tool_call>',
    "The answer is 111.",
]
TASK = CalculatorEnv.load_tasks("train", seed=0, n=1, digits=2)[0]


def _playing(chat, engine):
    """The calculator episode every test here plays, as a coroutine."""
    return run_episode(
        CalculatorEnv(),
        engine,
        chat,
        TASK,
        SamplingParams(max_new_tokens=64),
        seed=0,
        limits=EpisodeLimits(max_turns=4, max_tokens=400),
    )


def _episode(chat, engine):
    return asyncio.run(_playing(chat, engine))


def test_sglang_and_in_process_trajectories_are_identical(chat):
    local = _episode(chat, ScriptedEngine(chat.tokenizer, SCRIPT, chat.end_of_turn_id))

    async def through_http():
        backend = ScriptedEngine(chat.tokenizer, SCRIPT, chat.end_of_turn_id)
        server = FakeSGLang(backend=backend, eos_token_ids=chat.stop_token_ids)
        url = await server.start()
        engine = SGLangEngine([url])
        try:
            await engine.wait_ready()
            traj = await _playing(chat, engine)
            return traj, server.requests
        finally:
            await engine.aclose()
            await server.stop()

    remote, requests = asyncio.run(through_http())
    assert remote.token_ids == local.token_ids
    assert remote.loss_mask == local.loss_mask
    assert remote.logprobs == local.logprobs
    assert (
        (remote.stop_reason, remote.reward, remote.num_turns, remote.tool_errors)
        == (local.stop_reason, local.reward, local.num_turns, local.tool_errors)
        == (local.stop_reason, 1.0, 3, 1)
    )
    assert [m.role for m in remote.messages] == [m.role for m in local.messages]
    assert all(
        dataclasses.asdict(remote)[k] == dataclasses.asdict(local)[k]
        for k in ("prompt_len", "tool_calls")
    )
    # token-in: every request carried ids, never text, with the RL sampling settings
    assert len(requests) == 3 and all("input_ids" in r and "text" not in r for r in requests)
    assert all(
        r["sampling_params"]["no_stop_trim"] and not r["sampling_params"]["skip_special_tokens"]
        for r in requests
    )


def _by_turn(chat):
    """The script's turn for the episode asking (its assistant turns since the task's question;
    the env's examples come before it), whatever the order in which the group's episodes call."""

    def script(ids: list[int], i: int) -> str:
        turn = chat.decode(ids).rsplit("<|im_start|>user", 1)[1].count("<|im_start|>assistant")
        return SCRIPT[min(turn - 1, 2)]

    return script


def test_every_turn_of_a_groups_episodes_stays_on_one_server(chat):
    """run_group gives each episode a session id; over 2 servers each episode's turns all reach
    one server (told apart by their sampling seed, seed + index), and the group spreads over
    both."""

    async def go():
        backends = [  # one fast, one slow server: without sessions, turns would hop to the fast
            ScriptedEngine(chat.tokenizer, _by_turn(chat), chat.end_of_turn_id, delay_s=d)
            for d in (0.01, 0.08)
        ]
        servers = [FakeSGLang(backend=b, eos_token_ids=chat.stop_token_ids) for b in backends]
        engine = SGLangEngine([await s.start() for s in servers])
        try:
            g = await run_group(
                CalculatorEnv,
                engine,
                chat,
                TASK,
                4,
                SamplingParams(max_new_tokens=64, seed=100),
                seed=0,
                group_id="g",
                limits=EpisodeLimits(max_turns=4, max_tokens=400),
            )
            return g, [[r["sampling_params"]["sampling_seed"] for r in s.requests] for s in servers]
        finally:
            await engine.aclose()
            for s in servers:
                await s.stop()

    g, seeds = asyncio.run(go())
    assert [t.num_turns for t in g.trajectories] == [3] * 4
    assert all(seeds)  # both servers served episodes
    for i in range(4):  # episode i: 3 turns (seeds episode_seed(100, member=i, turn=k)), one server
        turns = {episode_seed(100, member=i, turn=k) for k in (1, 2, 3)}
        assert sorted(sum(x in turns for x in s) for s in seeds) == [0, 3]


def test_a_turn_sampled_across_a_weight_push_records_both_versions(chat, tmp_path):
    """Partial rollouts end to end: a push lands while the first turn is being decoded; the
    trajectory keeps every token and knows which version sampled each."""

    async def go():
        backend = ScriptedEngine(chat.tokenizer, _by_turn(chat), chat.end_of_turn_id)
        server = FakeSGLang(backend=backend, eos_token_ids=chat.stop_token_ids, weight_version="0")
        server.faults.token_delay_s = 0.03
        engine = SGLangEngine([await server.start()], partial_rollouts=True)
        try:
            episode = asyncio.create_task(_playing(chat, engine))
            while not any(it.produced for it in server._items.values()):
                await asyncio.sleep(0.005)
            await engine.update_weights_from_disk(tmp_path, version="1")
            return await episode, server.pauses[0]
        finally:
            await engine.aclose()
            await server.stop()

    traj, paused = asyncio.run(go())
    local = _episode(chat, ScriptedEngine(chat.tokenizer, SCRIPT, chat.end_of_turn_id))
    assert traj.token_ids == local.token_ids and traj.stop_reason == local.stop_reason
    (before,) = paused.values()
    assert traj.token_versions == ((before, 0), (traj.num_sampled - before, 1))
    assert traj.weight_versions == (0, 1)
