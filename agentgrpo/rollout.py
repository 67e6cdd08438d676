"""Rollouts: run multi-turn episodes against an engine, token-exact.

Each trajectory is its own asyncio task; a turn's request goes to the engine as soon as that
trajectory is ready (no lock-step batching across trajectories). Per turn:

    sampled = engine.generate(token_ids)          -> appended verbatim, loss_mask 1, engine logprobs
    message = chat.parse_assistant(sampled)       -> content + tool calls (+ malformed calls)
    env.step(message)                             -> tool/env messages, reward, terminated
    chat.suffix_ids(history, new messages)        -> appended, loss_mask 0, logprob 0

The episode ends when the env terminates or truncates, or at `max_turns`, at `max_tokens` sampled
plus suffix tokens after the prompt, at the model's context limit, or on an error. Failures of the
environment or the engine end only that trajectory (`ENV_ERROR`/`ENGINE_ERROR`, reward NaN so the
group statistics leave it out); malformed tool calls are answered with an error tool message and
counted (`tool_errors`), and the episode goes on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.chat import ChatFormat, TemplateError
from agentgrpo.engine.base import Engine, EngineError, SamplingParams
from agentgrpo.env import Env, call_env
from agentgrpo.types import Group, Message, StopReason, Task, Trajectory


class RolloutConfig(BaseModel):
    """How trajectories are sampled."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(8, ge=1, description="trajectories per task (G)")
    tasks_per_step: int = Field(4, ge=1, description="tasks (groups) per optimizer step")
    max_turns: int = Field(4, ge=1, description="assistant turns per episode")
    max_tokens: int = Field(512, ge=1, description="tokens after the prompt per trajectory (sampled + env)")
    max_new_tokens: int = Field(128, ge=1, description="tokens sampled per assistant turn")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature (the learner uses the same)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling")
    top_k: int = Field(-1, description="top-k sampling, -1 for all")
    episode_timeout_s: float = Field(600.0, gt=0, description="deadline of one episode")
    tool_error_penalty: float = Field(0.0, ge=0.0, description="subtracted from the reward per malformed or failed tool call")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k)


def _error_message(reason: str) -> Message:
    return Message(role="tool", content=f"Error: {reason}")


async def run_episode(env: Env, engine: Engine, chat: ChatFormat, task: Task,
                      params: SamplingParams, *, seed: int | None = None, max_turns: int = 4,
                      max_tokens: int = 512, context_len: int | None = None,
                      tool_error_penalty: float = 0.0) -> Trajectory:
    """Run one episode and return its Trajectory (never raises for env or engine failures)."""
    try:
        obs, _ = await call_env(env.reset, seed=seed, options={"task": task})
        messages: list[Message] = list(obs)
        tools = env.tool_schemas()
        token_ids = chat.prompt_ids(messages, tools)
    except Exception as e:  # noqa: BLE001 - env code is user code: its failure ends this trajectory
        return Trajectory(task_id=task.id, token_ids=[], loss_mask=[], logprobs=[], prompt_len=0,
                          messages=list(task.prompt_messages()), stop_reason=StopReason.ENV_ERROR,
                          stop_detail=f"reset raised {type(e).__name__}: {e}")
    traj = Trajectory(task_id=task.id, token_ids=token_ids, loss_mask=[0] * len(token_ids),
                      logprobs=[0.0] * len(token_ids), prompt_len=len(token_ids), messages=messages,
                      stop_reason=StopReason.MAX_TURNS, reward=0.0)
    params = replace(params, stop_token_ids=tuple(sorted(set(params.stop_token_ids) | set(chat.stop_token_ids))))
    versions: set[str] = set()

    def extend(ids: list[int], lps: list[float] | None) -> None:
        traj.token_ids += ids
        traj.loss_mask += [1 if lps is not None else 0] * len(ids)
        traj.logprobs += lps if lps is not None else [0.0] * len(ids)

    def finish(reason: StopReason, detail: str = "", reward: float | None = None) -> Trajectory:
        traj.stop_reason, traj.stop_detail = reason, detail
        if reason.is_infra_error:
            traj.reward = math.nan
        elif reward is not None:
            traj.reward = reward
        if traj.tool_errors and tool_error_penalty and not math.isnan(traj.reward):
            traj.reward -= tool_error_penalty * traj.tool_errors
        traj.weight_version = ",".join(sorted(versions)) or None
        return traj

    for turn in range(max_turns):
        budget = min(params.max_new_tokens, max_tokens - (len(traj.token_ids) - traj.prompt_len))
        if context_len is not None:
            budget = min(budget, context_len - len(traj.token_ids))
        if budget <= 0:
            return finish(StopReason.MAX_TOKENS, "token budget used up before the turn")
        try:
            out = await engine.generate(list(traj.token_ids), replace(params, max_new_tokens=budget))
        except EngineError as e:
            return finish(StopReason.ENGINE_ERROR, str(e))
        if out.weight_version is not None:
            versions.add(out.weight_version)
        traj.num_turns = turn + 1
        extend(out.token_ids, out.logprobs)
        if out.finish_reason == "abort":
            return finish(StopReason.ABORTED, out.detail or "the engine aborted the request")
        parsed = chat.parse_assistant(out.token_ids)
        messages.append(parsed.message)
        if out.finish_reason == "length":
            # No end-of-turn token was sampled: the turn is cut, so the episode ends here (as verl
            # and slime do) rather than appending an end-of-turn token the model never produced.
            return finish(StopReason.MAX_TOKENS, out.detail or f"turn {turn + 1} hit the token limit")
        n_calls = len(parsed.message.tool_calls or [])
        traj.tool_calls += n_calls + len(parsed.errors)
        traj.tool_errors += len(parsed.errors)
        try:
            if n_calls or not parsed.errors:
                new, reward, terminated, truncated, info = await call_env(env.step, parsed.message)
            else:  # only malformed calls: the env sees nothing, the model gets the errors
                new, reward, terminated, truncated, info = [], 0.0, False, False, {}
        except Exception as e:  # noqa: BLE001 - env code is user code
            return finish(StopReason.ENV_ERROR, f"step raised {type(e).__name__}: {e}")
        traj.reward += float(reward)
        traj.tool_errors += int(info.get("tool_errors", 0))
        new = list(new) + [_error_message(f"malformed tool call: {err.reason}") for err in parsed.errors]
        if terminated or truncated:
            messages.extend(new)
            return finish(StopReason.COMPLETED if terminated else StopReason.TRUNCATED)
        if not new:
            return finish(StopReason.ENV_ERROR, "step returned no messages but did not end the episode")
        try:
            suffix = chat.suffix_ids(messages, new, tools)
        except TemplateError as e:
            return finish(StopReason.ENV_ERROR, str(e))
        messages.extend(new)
        extend(suffix, None)
    return finish(StopReason.MAX_TURNS, f"{max_turns} turns")


async def run_group(env_factory: Callable[[], Env], engine: Engine, chat: ChatFormat, task: Task,
                    group_size: int, params: SamplingParams, *, seed: int | None = None,
                    group_id: str | None = None, episode_timeout_s: float | None = None,
                    on_done: Callable[[Trajectory], None] | None = None,
                    **episode_kwargs: Any) -> Group:
    """Sample `group_size` trajectories of one task concurrently, all from the same env seed.

    Each member gets its own sampling seed (`params.seed + i`) so members differ; the env seed is
    shared so all members start from the same state.
    """
    gid = group_id or task.id

    async def one(i: int) -> Trajectory:
        p = params if params.seed is None else replace(params, seed=params.seed + i)
        start = time.monotonic()
        try:
            traj = await asyncio.wait_for(
                run_episode(env_factory(), engine, chat, task, p, seed=seed, **episode_kwargs),
                timeout=episode_timeout_s,
            )
        except asyncio.TimeoutError:
            traj = Trajectory(task_id=task.id, token_ids=[], loss_mask=[], logprobs=[], prompt_len=0,
                              messages=task.prompt_messages(), stop_reason=StopReason.TIMEOUT,
                              stop_detail=f"episode exceeded {episode_timeout_s:g} s")
        traj.group_id = gid
        traj.info["wall_s"] = round(time.monotonic() - start, 4)
        if on_done is not None:
            on_done(traj)
        return traj

    return Group(group_id=gid, task=task, trajectories=list(await asyncio.gather(*(one(i) for i in range(group_size)))))


async def collect(env_factory: Callable[[], Env], engine: Engine, chat: ChatFormat,
                  tasks: Sequence[Task], cfg: RolloutConfig, *, seed: int = 0,
                  context_len: int | None = None, on_done: Callable[[Trajectory], None] | None = None) -> list[Group]:
    """All groups of one step, concurrently. `on_done` is called as each trajectory finishes."""
    params = replace(cfg.sampling_params(), seed=seed * 1_000_003)

    async def group(i: int, task: Task) -> Group:
        return await run_group(env_factory, engine, chat, task, cfg.group_size,
                               replace(params, seed=params.seed + i * cfg.group_size),
                               seed=seed + i, group_id=f"{seed}:{i}:{task.id}",
                               episode_timeout_s=cfg.episode_timeout_s, on_done=on_done,
                               max_turns=cfg.max_turns, max_tokens=cfg.max_tokens,
                               context_len=context_len, tool_error_penalty=cfg.tool_error_penalty)

    return list(await asyncio.gather(*(group(i, t) for i, t in enumerate(tasks))))
