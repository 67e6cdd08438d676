"""A multi-turn tool episode through SGLangEngine (over real HTTP to the protocol-faithful fake
server) gives exactly the trajectory the same scripted engine gives in-process."""

import asyncio
import dataclasses

from agentgrpo.engine import SamplingParams, SGLangEngine
from agentgrpo.rollout import EpisodeLimits, run_episode
from envs.calculator import CalculatorEnv
from tests.fake_sglang import FakeSGLang
from tests.fakes import ScriptedEngine

SCRIPT = [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "56+55"}}\n</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expr": 1}}</tool_call>',
    "The answer is 111.",
]
TASK = CalculatorEnv.load_tasks("train", seed=0, n=1, digits=2)[0]


def _episode(chat, engine):
    return asyncio.run(
        run_episode(
            CalculatorEnv(),
            engine,
            chat,
            TASK,
            SamplingParams(max_new_tokens=64),
            seed=0,
            limits=EpisodeLimits(max_turns=4, max_tokens=400),
        )
    )


def test_sglang_and_in_process_trajectories_are_identical(chat):
    local = _episode(chat, ScriptedEngine(chat.tokenizer, SCRIPT, chat.end_of_turn_id))

    async def through_http():
        backend = ScriptedEngine(chat.tokenizer, SCRIPT, chat.end_of_turn_id)
        server = FakeSGLang(backend=backend, eos_token_ids=chat.stop_token_ids)
        url = await server.start()
        engine = SGLangEngine([url])
        try:
            await engine.wait_ready()
            traj = await run_episode(
                CalculatorEnv(),
                engine,
                chat,
                TASK,
                SamplingParams(max_new_tokens=64),
                seed=0,
                limits=EpisodeLimits(max_turns=4, max_tokens=400),
            )
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
