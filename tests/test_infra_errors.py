"""Infrastructure failures inside tools end the trajectory as unscorable (NaN), never as a 0 or as
an error message the model is blamed for."""

import asyncio
import math

from agentgrpo import StopReason, Task, ToolEnv, tool
from agentgrpo.engine import SamplingParams
from agentgrpo.rollout.episode import run_episode
from agentgrpo.verify.sandbox import SandboxUnavailable
from tests.fakes import ScriptedEngine


class SandboxDown(ToolEnv):
    @tool
    def python(self, code: str) -> str:
        """Run code."""
        raise SandboxUnavailable("sandbox unavailable: supervisor died")

    def reward(self, task, messages):
        return 1.0


def test_sandbox_outage_is_unscorable(chat):
    engine = ScriptedEngine(
        chat.tokenizer,
        ['<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'],
        chat.end_of_turn_id,
    )
    traj = asyncio.run(
        run_episode(SandboxDown(), engine, chat, Task(id="t", prompt="hi"), SamplingParams())
    )
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward)
    assert "supervisor died" in traj.stop_detail
    assert not any(m.role == "tool" for m in traj.messages)  # the model was never shown an error
