"""Runs that train on episodes played elsewhere: `env: {name: remote}` (`RemoteEnv`).

Each episode of the run waits, with its task, for an agent in another process or machine: the
agent asks serve-policy's episode API for one (`POST /episodes`), plays it against the episode's
URL with any of the endpoint's APIs, and ends it by posting a reward or, leaving the score to the
env's rubric, with `DELETE /episodes/<id>`. Every call is recorded token-exactly as for an
`AgentEnv`, with the same groups, seeds, limits, deadlines and NaN rules as any env's: an episode
no agent takes or ends ends at its deadline as TIMEOUT, unscorable.

The server runs on a thread of its own (`agentgrpo-remote`) from the first episode until the
process exits, so agents can ask for tasks while the learner trains; its calls generate on the
run's event loop, where the engine lives. It needs a token on every address, loopback too.
docs/agents.md, "Remote runs", has the API and the settings.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import importlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentgrpo.agents.agent_env import sealed, training_episode
from agentgrpo.agents.endpoint import EndpointEpisode, PolicyEndpoint
from agentgrpo.chat.format import ChatFormat
from agentgrpo.deadlines import DeadlineExpired, Deadlines
from agentgrpo.engine.base import Engine, SamplingParams
from agentgrpo.env.base import Env, get_env_class
from agentgrpo.env.rubric import Rubric
from agentgrpo.env.runner import EpisodeRunner
from agentgrpo.rollout.episode import EpisodeLimits
from agentgrpo.types import Message, StopReason, Task, Trajectory

TOKEN_ENV = "AGENTGRPO_POLICY_TOKEN"  # as for serve-policy


class RemoteEnv(Env, EpisodeRunner):
    """An env whose episodes are played by agents in other processes (see the module docstring).

    `host`, `port`: where the run's episode server listens. `token_file`: the bearer token
    (default: $AGENTGRPO_POLICY_TOKEN; required, on loopback too). `verifier`: `module:function`, a
    verifier `(trajectory, task) -> float` that scores the episodes an agent ends without a
    reward (the env's rubric). Tasks come from another env's `load_tasks` (`env.tasks: {env:
    calculator, ...}`, the other keys its arguments) or from a file (`env.tasks: {file: ...}`).

    Example:
        env: {name: remote, kwargs: {port: 8100}, tasks: {env: calculator, digits: 2}}
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8100,
        token_file: str | None = None,
        verifier: str | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.token = _read_token(token_file)
        if self.token is None:  # a loopback port is open to every local user: never without
            raise ValueError(
                f"RemoteEnv: refusing to serve episodes on {host} without a token: set "
                f"${TOKEN_ENV} (the agents send it too) or token_file"
            )
        self._rubric = None if verifier is None else Rubric([("verifier", _load(verifier), 1.0)])

    @property
    def rubric(self) -> Rubric | None:
        return self._rubric

    @classmethod
    def load_tasks(
        cls,
        split: str = "train",
        seed: int = 0,
        *,
        env: str | None = None,
        file: str | None = None,
        **kwargs: Any,
    ) -> list[Task]:
        if env is not None:
            return list(get_env_class(env).load_tasks(split, seed=seed, **kwargs))
        return list(super().load_tasks(split, seed, file=file, **kwargs))

    def step(self, action: Message) -> Any:
        raise TypeError("a RemoteEnv's episodes are played by remote agents, not step()")

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
        """Offer the episode to the agents and wait until one ends it or its deadline passes."""
        clock = Deadlines(limits.turn_timeout_s, limits.episode_timeout_s, deadline)
        # the session names the group and member (sticky routing); within the endpoint's ids
        session = re.sub(r"[^A-Za-z0-9._-]", "-", params.session_id or "episode")[:100]
        eid = f"{session}-{os.urandom(6).hex()}".lstrip(".")
        episode = training_episode(
            RemoteEpisode,
            eid,
            engine,
            chat,
            params,
            limits,
            context_len,
            clock,
            home=asyncio.get_running_loop(),
        )
        hub = _hub(self.host, self.port, self.token)
        done: concurrent.futures.Future = concurrent.futures.Future()
        hub.offer(episode, task, done)
        reason, detail, reward = StopReason.COMPLETED, "", None
        try:
            reward = await clock.run(asyncio.wrap_future(done))
        except DeadlineExpired as e:
            who = "its agent did not end it" if episode.taken else "no agent took it"
            reason, detail = StopReason.TIMEOUT, f"{e} ({who})"
            if episode.cut is None:
                episode.cut, episode.deadline = (reason, detail), e.which
        finally:
            hub.withdraw(episode.id)
        return sealed(self, episode, task, limits, reason, detail, reward)


@dataclass
class RemoteEpisode(EndpointEpisode):
    """An endpoint episode whose calls arrive on the remote server's thread and generate on
    `home`, the run's event loop (where the engine and the episode's deadlines live)."""

    home: asyncio.AbstractEventLoop | None = None
    taken: bool = False  # handed out to an agent

    async def complete(self, body: Any) -> dict[str, Any]:
        run_here = super().complete(body)
        if self.home is None or self.home is asyncio.get_running_loop():
            return await run_here
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run_here, self.home))


class _Hub:
    """The remote episode server of one address: a PolicyEndpoint on its own thread and loop,
    and the episodes waiting for an agent (touched on that loop only)."""

    def __init__(self, host: str, port: int, token: str | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.endpoint = PolicyEndpoint(token=token, hand_out=self._hand_out, on_done=self._done)
        self.offers: dict[str, tuple[RemoteEpisode, Task, concurrent.futures.Future]] = {}
        self.waiting: collections.deque[str] = collections.deque()
        self.arrived: asyncio.Event | None = None
        self.stop: asyncio.Event | None = None
        self.base: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self.loop.run_forever, name="agentgrpo-remote", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(host, port), self.loop)
        self.url = self.base.result(timeout=60)  # a port in use raises here

    async def _serve(self, host: str, port: int) -> None:
        self.arrived, self.stop = asyncio.Event(), asyncio.Event()
        try:
            async with self.endpoint.serving(host, port) as base:
                self.base.set_result(base)
                await self.stop.wait()
        except BaseException as e:
            if not self.base.done():
                self.base.set_exception(e)
            raise

    def offer(self, episode: RemoteEpisode, task: Task, done: concurrent.futures.Future) -> None:
        def add() -> None:
            self.offers[episode.id] = (episode, task, done)
            self.waiting.append(episode.id)
            self.arrived.set()  # type: ignore[union-attr]

        self.loop.call_soon_threadsafe(add)

    def withdraw(self, eid: str) -> None:
        def remove() -> None:
            self.offers.pop(eid, None)
            self.endpoint.remove(eid)

        self.loop.call_soon_threadsafe(remove)

    async def _hand_out(self, wait_s: float) -> tuple[EndpointEpisode, dict] | None:
        end = self.loop.time() + wait_s
        while True:
            while self.waiting:
                eid = self.waiting.popleft()
                if eid in self.offers:
                    episode, task, _ = self.offers[eid]
                    episode.taken = True
                    return episode, {"task": task.model_dump(mode="json")}
            self.arrived.clear()  # type: ignore[union-attr]
            left = end - self.loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.arrived.wait(), left)  # type: ignore[union-attr]
            except asyncio.TimeoutError:
                return None

    def _done(self, episode: EndpointEpisode) -> None:
        """A reward was posted (the agent's score) or the episode deleted (the rubric's)."""
        self.endpoint.remove(episode.id)  # no call after the end is recorded
        entry = self.offers.pop(episode.id, None)
        if entry is not None and not entry[2].done():
            entry[2].set_result(episode.reward)

    def close(self) -> None:
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)


_hubs: dict[tuple[str, int], _Hub] = {}
_hubs_lock = threading.Lock()


def _hub(host: str, port: int, token: str | None) -> _Hub:
    with _hubs_lock:
        hub = _hubs.get((host, port))
        if hub is None:
            hub = _hubs[(host, port)] = _Hub(host, port, token)
        elif hub.endpoint.token != token:
            raise ValueError(f"the remote episode server on {host}:{port} has another token")
        return hub


def stop_servers() -> None:
    """Stop this process's remote episode servers (tests; a run's server lives until exit)."""
    with _hubs_lock:
        for hub in _hubs.values():
            hub.close()
        _hubs.clear()


def _read_token(token_file: str | None) -> str | None:
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"RemoteEnv: token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def _load(name: str) -> Any:
    """The verifier `module:function` names; ValueError naming what is wrong."""
    module, _, attr = name.partition(":")
    if not (module and attr):
        raise ValueError(f"RemoteEnv: verifier must be module:function, got {name!r}")
    found = getattr(importlib.import_module(module), attr, None)
    if not callable(found):
        raise ValueError(f"RemoteEnv: {name!r} is not a function")
    return found
