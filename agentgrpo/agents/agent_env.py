"""Agents you already have: `AgentEnv`, an env whose episode is the user's own OpenAI-client code.

The subclass writes `async def run(self, client, task)`; `client` is an `openai.AsyncOpenAI`
bound to this episode's URL on a policy endpoint (`agentgrpo.agents.endpoint`) that this process
serves on 127.0.0.1 while AgentEnv episodes run (one server per event loop; each episode has its
own key). Every call is recorded token-exactly there, and the trajectory builder makes the calls
the episode's token sequences, segments where a prompt does not extend the previous call.

Limits as for any env (`EpisodeLimits`): a call past `max_turns` or the token budget is a 400
(`code: episode_limit`) that ends the episode as MAX_TURNS / MAX_TOKENS; deadlines end it as
TIMEOUT, an engine failure as ENGINE_ERROR (both unscorable), an exception of `run` as ENV_ERROR.
The reward is `run`'s return value, or the env's `rubric` when it returns None. The client does
not retry: a retried call would be a second turn. docs/agents.md, "AgentEnv".
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import secrets
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from agentgrpo.agents.endpoint import EndpointEpisode, PolicyEndpoint, episode_urls
from agentgrpo.chat.format import ChatFormat
from agentgrpo.deadlines import DeadlineExpired, Deadlines
from agentgrpo.engine.base import Engine, SamplingParams
from agentgrpo.env.base import Env, call_env, env_rubric
from agentgrpo.env.runner import EpisodeRunner
from agentgrpo.rollout.episode import EpisodeLimits
from agentgrpo.types import Message, StopReason, Task, Trajectory

if TYPE_CHECKING:
    import openai

E = TypeVar("E", bound=EndpointEpisode)


class AgentEnv(Env, EpisodeRunner):
    """An env whose episode is `run(client, task)`: agent code written against the OpenAI client.

    `run` returns the episode's reward (a finite number), or None to leave it to the env's
    `rubric`. `self.base_url`, `self.api_key` and `self.model` are set before `run` starts, for
    agent code that builds its own client (the OpenAI Agents SDK, LangChain's `ChatOpenAI`;
    `self.anthropic_base_url` for Anthropic's client, which adds `/v1/messages` itself); such a
    client should not retry (`max_retries=0`). `self.api_key` is the episode's own key: it opens
    this episode's routes and nothing else. What `run` puts in `self.episode_info` (a dict of JSON
    values) becomes the trajectory's `env_info`.

    Example:
        >>> from agentgrpo.agents.agent_env import AgentEnv
        >>> class Calculator(AgentEnv):
        ...     async def run(self, client, task):
        ...         messages = [{"role": "user", "content": task.prompt}]
        ...         reply = await client.chat.completions.create(model=self.model,
        ...                                                      messages=messages)
        ...         return float(str(task.answer) in (reply.choices[0].message.content or ""))
    """

    base_url: str = ""
    anthropic_base_url: str = ""
    api_key: str = ""
    model: str = "policy"
    # What `run` reports about its episode (JSON values), kept as the trajectory's `env_info`.
    episode_info: dict[str, Any]

    async def run(self, client: openai.AsyncOpenAI, task: Task) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} must implement async run(client, task)")

    def step(self, action: Message) -> Any:
        raise TypeError(
            f"{type(self).__name__} is an AgentEnv: its episode is run(client, task), not step()"
        )

    async def run_own_episode(
        self,
        engine: Engine,
        chat: ChatFormat,
        task: Task,
        params: SamplingParams,
        *,
        limits: EpisodeLimits,
        seed: int | None = None,
        context_len: int | None = None,
        deadline: float | None = None,
    ) -> Trajectory:
        """`EpisodeRunner`: the rollout hands this env its episode (`agent_episode`)."""
        return await agent_episode(
            self,
            engine,
            chat,
            task,
            params,
            limits=limits,
            seed=seed,
            context_len=context_len,
            deadline=deadline,
        )


async def agent_episode(
    env: AgentEnv,
    engine: Engine,
    chat: ChatFormat,
    task: Task,
    params: SamplingParams,
    *,
    limits: EpisodeLimits,
    seed: int | None = None,
    context_len: int | None = None,
    deadline: float | None = None,
) -> Trajectory:
    """One AgentEnv episode as a Trajectory; never raises for env, engine or deadline failures."""
    import openai  # the optional extra: pip install 'agentgrpo[agent]'

    clock = Deadlines(limits.turn_timeout_s, limits.episode_timeout_s, deadline)
    episode = training_episode(
        EndpointEpisode, secrets.token_urlsafe(12), engine, chat, params, limits, context_len, clock
    )
    reason, detail, reward = StopReason.COMPLETED, "", None
    async with _shared_endpoint() as (endpoint, base):
        endpoint.add(episode)
        # the episode's own key: good for this episode's calls only (not another's, nor the API)
        urls = episode_urls(episode, base)
        env.base_url, env.anthropic_base_url = urls["base_url"], urls["anthropic_base_url"]
        env.api_key = urls["api_key"]
        env.model, env.episode_info = endpoint.model, {}
        client = openai.AsyncOpenAI(base_url=env.base_url, api_key=env.api_key, max_retries=0)
        stage = "reset"
        try:
            await clock.run(
                call_env(env.reset, seed=seed, options={"task": task})
            )  # seeds np_random
            stage = "run"
            reward = await clock.run(env.run(client, task))
            if reward is not None and (
                isinstance(reward, bool)
                or not isinstance(reward, numbers.Real)
                or not math.isfinite(reward)
            ):
                reason, detail = (
                    StopReason.ENV_ERROR,
                    f"run returned {reward!r:.100}, not a finite number or None",
                )
                reward = None
        except DeadlineExpired as e:
            reason, detail = StopReason.TIMEOUT, str(e)
            if episode.cut is None:
                episode.cut, episode.deadline = (reason, detail), e.which
        except Exception as e:  # noqa: BLE001 - the agent is user code: its failure ends this episode
            reason, detail = StopReason.ENV_ERROR, f"{stage} raised {type(e).__name__}: {e}"
        finally:
            endpoint.remove(episode.id)
            await client.close()
    traj = sealed(env, episode, task, limits, reason, detail, reward)
    info = json.loads(json.dumps(env.episode_info, default=str, skipkeys=True))
    return replace(traj, env_info=info)


def training_episode(
    kind: type[E],
    eid: str,
    engine: Engine,
    chat: ChatFormat,
    params: SamplingParams,
    limits: EpisodeLimits,
    context_len: int | None,
    clock: Deadlines,
    **extra: Any,
) -> E:
    """An endpoint episode of a training run: the run's sampling (requests may not change it), its
    seed for this member and the run's limits (shared with `agentgrpo.agents.remote`)."""
    return kind(
        id=eid,
        engine=engine,
        chat=chat,
        params=params,
        context_len=context_len,
        fixed_sampling=True,
        seed=params.seed,
        max_calls=limits.max_turns,
        max_tokens=limits.max_tokens,
        clock=clock,
        **extra,
    )


def sealed(
    env: Env,
    episode: EndpointEpisode,
    task: Task,
    limits: EpisodeLimits,
    reason: StopReason,
    detail: str,
    reward: float | None,
) -> Trajectory:
    """The episode's record: the endpoint's token sequences, why it ended (the agent's own ending
    unless the endpoint saw an engine failure, a divergent prompt or a limit) and its reward (the
    agent's; None leaves it to the env's rubric). Shared with remote episodes
    (`agentgrpo.agents.remote`)."""
    traj, diverged = episode.trajectory(task.id)
    if not episode.calls and reason == StopReason.COMPLETED:
        reason, detail = StopReason.ENV_ERROR, "run made no call to the model"
    reason, detail = episode.ending(diverged, (reason, detail))
    if reward is None and not reason.is_infra_error:
        # None leaves the reward to the rubric; without one, an episode cut by a limit scores
        # what the env gave (nothing), and a finished one is an error of the env
        if env_rubric(env) is None and reason == StopReason.COMPLETED:
            reason = StopReason.ENV_ERROR
            detail = "the agent gave no reward and the env has no rubric to score the episode"
        reward = 0.0
    elif reward is not None and traj.tool_errors and limits.tool_error_penalty:
        reward -= limits.tool_error_penalty * traj.tool_errors
    return replace(
        traj,
        messages=traj.messages if episode.calls else task.prompt_messages(),
        stop_reason=reason,
        stop_detail=detail,
        deadline=episode.deadline if reason == StopReason.TIMEOUT else None,
        reward=math.nan if reason.is_infra_error else float(reward),
    )


class _Shared:
    """The endpoint this event loop's AgentEnv episodes share: served while any runs."""

    def __init__(self) -> None:
        self.endpoint = PolicyEndpoint(token=secrets.token_urlsafe(24))
        self.users = 0
        self.lock = asyncio.Lock()
        self.base = ""
        self._serving: Any = None

    async def __aenter__(self) -> tuple[PolicyEndpoint, str]:
        async with self.lock:
            if self.users == 0:
                self._serving = self.endpoint.serving()
                self.base = await self._serving.__aenter__()
            self.users += 1
        return self.endpoint, self.base

    async def __aexit__(self, *exc: Any) -> None:
        async with self.lock:
            self.users -= 1
            if self.users == 0:
                serving, self._serving = self._serving, None
                await serving.__aexit__(None, None, None)


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Shared] = (
    weakref.WeakKeyDictionary()
)


def _shared_endpoint() -> _Shared:
    loop = asyncio.get_running_loop()
    if loop not in _by_loop:
        _by_loop[loop] = _Shared()
    return _by_loop[loop]
