"""The policy endpoint's HTTP app: every API's routes per episode, and the episode API.

Server: starlette on uvicorn (well-kept, asynchronous, light: the app is a few routes and needs
no validation framework), set up in `agentgrpo.agents.server`: connections, request heads and
bodies bounded for every route (`ServerLimits`), the Host header checked on a loopback bind.
Binds 127.0.0.1 unless told otherwise; a token (`Authorization: Bearer`, which is what the OpenAI
client sends as its api_key, or `x-api-key`, Anthropic's) is then required, compared in constant
time. Each episode has a key of its own (`EndpointEpisode.token`), good only for its
`/episodes/<id>/v1/` routes (every API's). Request bodies, read for every route by
`PolicyEndpoint._json`: at most `max_body_bytes` (413), JSON at most `MAX_JSON_DEPTH` deep (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentgrpo.agents import anthropic, responses
from agentgrpo.agents.api_error import APIError
from agentgrpo.agents.chat_episode import Call, EndpointEpisode, chat_answer
from agentgrpo.agents.chat_request import EPISODE_ID, MAX_JSON_DEPTH, SEED_RANGE, nested_deeper
from agentgrpo.agents.server import Auth, Effective, HostRule, ServerLimits, is_loopback, serve_app
from agentgrpo.types import StopReason

__all__ = ["Call", "EndpointEpisode", "PolicyEndpoint", "chat_answer", "episode_urls"]


class PolicyEndpoint:
    """The episodes table and its HTTP app (`app`): per episode `/episodes/<id>/v1/` +
    `chat/completions`, `responses` (`agentgrpo.agents.responses`), `messages` (Anthropic's:
    `agentgrpo.agents.anthropic`) and `models`; `/v1/models`.

    With `new_episode` (serve-policy) it also serves the episode API: `POST /episodes` (body
    `{"id"?, "seed"?}`: starts one made by `new_episode(id, seed)`, answers its id and URLs),
    `GET /episodes/<id>/trajectory`, `POST /episodes/<id>/reward` (`{"reward": float}`),
    `DELETE /episodes/<id>`. With `hand_out` instead (a remote run: `agentgrpo.agents.remote`),
    `POST /episodes` hands out an episode that waits for an agent.

    Example (one episode on the embedded model, called through OpenAI's client):
        ```python
        import asyncio
        import openai
        from agentgrpo.agents.endpoint import EndpointEpisode, PolicyEndpoint, episode_urls
        from agentgrpo.chat.format import ChatFormat
        from agentgrpo.engine import LocalEngine, SamplingParams
        from agentgrpo.models.embedded import default_model_path

        async def main():
            with LocalEngine(default_model_path()) as engine:
                endpoint = PolicyEndpoint(model="policy")
                ep = endpoint.add(EndpointEpisode(id="ep1", engine=engine,
                                                  chat=ChatFormat(engine.tokenizer),
                                                  params=SamplingParams(max_new_tokens=64)))
                async with endpoint.serving() as base:  # http://127.0.0.1:PORT
                    urls = episode_urls(ep, base)  # base_url, api_key: this episode's
                    client = openai.AsyncOpenAI(base_url=urls["base_url"],
                                                api_key=urls["api_key"], max_retries=0)
                    reply = await client.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": "What is 2+3?"}])
                    print(reply.choices[0].message.content)
                trajectory, _ = ep.trajectory("t1")  # the call's token ids, loss mask 1 on sampled

        asyncio.run(main())
        ```
    """

    def __init__(
        self,
        *,
        model: str = "policy",
        token: str | None = None,
        max_body_bytes: int = 4 << 20,
        max_episodes: int = 10_000,
        new_episode: Callable[[str, int | None], EndpointEpisode] | None = None,
        limits: ServerLimits | None = None,
        hand_out: Callable[[float], Awaitable[tuple[EndpointEpisode, dict] | None]] | None = None,
        on_done: Callable[[EndpointEpisode], None] | None = None,
    ) -> None:
        self.model, self.token, self.max_body_bytes = model, token, max_body_bytes
        self.limits = limits or ServerLimits()
        self.effective: Effective | None = None  # the limits in effect while serving
        self._hosts = HostRule()
        self.max_episodes = max_episodes  # episodes held at once (POST /episodes: 429 past it)
        self.episodes: dict[str, EndpointEpisode] = {}
        self.new_episode = new_episode
        # a remote run's episodes (agentgrpo.agents.remote): POST /episodes hands out one that
        # waits for an agent (`hand_out(wait_s)`: the episode and what else the answer carries,
        # or None when none came in time), and a reward or DELETE tells `on_done` it is over
        self.hand_out, self.on_done = hand_out, on_done
        routes = [
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/episodes/{eid}/v1/models", self._models, methods=["GET"]),
            Route("/episodes/{eid}/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/episodes/{eid}/v1/responses", self._responses, methods=["POST"]),
            Route("/episodes/{eid}/v1/messages", self._messages, methods=["POST"]),
        ]
        if new_episode is not None or hand_out is not None:
            routes += [
                Route("/episodes", self._start, methods=["POST"]),
                Route("/episodes/{eid}/trajectory", self._trajectory, methods=["GET"]),
                Route("/episodes/{eid}/reward", self._reward, methods=["POST"]),
                Route("/episodes/{eid}", self._end, methods=["DELETE"]),
            ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={
                404: lambda _r, _e: APIError(
                    404, "no such route; chat completions are at /episodes/<id>/v1/chat/completions"
                ).response(),
                405: lambda _r, _e: APIError(405, "method not allowed").response(),
                Exception: lambda _r, e: APIError(
                    500, f"internal error: {type(e).__name__}", kind="server_error"
                ).response(),
            },
        )
        self.app.add_middleware(
            Auth,
            token=token,
            hosts=self._hosts,
            episode_token=self._episode_token,
            error=_refusal,
        )

    def add(self, episode: EndpointEpisode) -> EndpointEpisode:
        if not EPISODE_ID.fullmatch(episode.id):
            raise ValueError(f"episode id {episode.id!r:.60}: expected {EPISODE_ID.pattern}")
        if episode.id in self.episodes:
            raise ValueError(f"episode {episode.id!r} exists already")
        self.episodes[episode.id] = episode
        return episode

    def remove(self, eid: str) -> EndpointEpisode | None:
        return self.episodes.pop(eid, None)

    def _episode_token(self, path: str) -> str | None:
        """The token of the episode whose OpenAI routes `path` is under (`/episodes/<id>/v1/`)."""
        parts = path.split("/", 4)
        if len(parts) < 5 or parts[1] != "episodes" or parts[3] != "v1":
            return None
        ep = self.episodes.get(parts[2])
        return None if ep is None else ep.token

    def _episode(self, request: Request) -> EndpointEpisode:
        eid = request.path_params["eid"]
        ep = self.episodes.get(eid)
        if ep is None:
            raise APIError(
                404,
                f"no episode {eid!r} (ended, or never started)",
                param="episode",
                code="episode_not_found",
            )
        return ep

    async def _json(self, request: Request) -> Any:
        size = int(request.headers.get("content-length") or 0)
        if size > self.max_body_bytes:
            raise APIError(413, f"request body over {self.max_body_bytes} bytes")
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > self.max_body_bytes:
                    raise APIError(413, f"request body over {self.max_body_bytes} bytes")

        try:
            await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError as e:
            raise APIError(
                408, f"the request body did not arrive within {self.limits.body_timeout_s} s"
            ) from e
        try:
            parsed = json.loads(body) if body else {}
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request ({e})") from e
        if nested_deeper(parsed, MAX_JSON_DEPTH):
            raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
        return parsed

    async def _chat(self, request: Request) -> Response:
        return await self._call(request, chat_answer, APIError.response)

    async def _responses(self, request: Request) -> Response:
        return await self._call(request, responses.answer, APIError.response)

    async def _messages(self, request: Request) -> Response:
        return await self._call(request, anthropic.answer, anthropic.error_response)

    async def _call(
        self,
        request: Request,
        answer: Callable[[EndpointEpisode, Any, str], Awaitable[Response]],
        error: Callable[[APIError], Response],
    ) -> Response:
        """One call of an API: its episode, its body, and the API's answer (`answer(episode,
        body, served model name)`, which calls `EndpointEpisode.complete`), or its error."""
        try:
            ep = self._episode(request)
            return await answer(ep, await self._json(request), self.model)
        except APIError as e:
            return error(e)

    async def _models(self, request: Request) -> JSONResponse:
        if "eid" in request.path_params:
            try:
                self._episode(request)
            except APIError as e:
                return e.response()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "created": 0, "owned_by": "agentgrpo"}
                ],
            }
        )

    async def _start(self, request: Request) -> Response:
        if self.hand_out is not None:
            return await self._take(request)
        try:
            body = await self._json(request)
            if not isinstance(body, dict) or set(body) - {"id", "seed"}:
                raise APIError(400, 'body: {"id"?: str, "seed"?: int}')
            eid, seed = body.get("id") or secrets.token_urlsafe(12), body.get("seed")
            if not isinstance(eid, str) or not EPISODE_ID.fullmatch(eid):
                raise APIError(
                    400,
                    f"id must be 1-128 characters of A-Z a-z 0-9 . _ - (not starting with "
                    f"'.'), got {eid!r:.60}",
                    param="id",
                )
            if seed is not None and (
                type(seed) is not int or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]
            ):
                raise APIError(
                    400, f"seed must be a signed 64-bit integer, got {seed!r:.60}", param="seed"
                )
            if eid in self.episodes:
                raise APIError(409, f"episode {eid!r} exists already", param="id")
            if len(self.episodes) >= self.max_episodes:
                raise APIError(
                    429,
                    f"{self.max_episodes} episodes are held: DELETE finished ones",
                    kind="rate_limit_error",
                    code="too_many_episodes",
                )
            ep = self.add(self.new_episode(eid, seed))  # type: ignore[misc]
            base = str(request.base_url).rstrip("/")  # the Host the client used (checked: Auth)
            return JSONResponse(episode_urls(ep, base))
        except APIError as e:
            return e.response()

    async def _take(self, request: Request) -> Response:
        """POST /episodes of a remote run: an episode waiting for an agent (its id, URLs and
        task), or 204 when none came within the body's `wait_s` (default 20, at most 60)."""
        try:
            body = await self._json(request)
            wait_s = body.get("wait_s", 20.0) if isinstance(body, dict) else None
            if (
                not isinstance(body, dict)
                or set(body) - {"wait_s"}
                or isinstance(wait_s, bool)
                or not isinstance(wait_s, int | float)
                or not 0 <= wait_s <= 60
            ):
                raise APIError(400, 'body: {"wait_s"?: seconds to wait for a task, 0 to 60}')
            taken = await self.hand_out(float(wait_s))  # type: ignore[misc]
            if taken is None:
                return Response(status_code=204)
            ep, extra = taken
            self.add(ep)
            base = str(request.base_url).rstrip("/")  # the Host the client used (checked: Auth)
            return JSONResponse({**episode_urls(ep, base), **extra})
        except APIError as e:
            return e.response()

    async def _trajectory(self, request: Request) -> JSONResponse:
        try:
            ep = self._episode(request)
        except APIError as e:
            return e.response()
        traj, diverged = ep.trajectory(ep.id)
        reason, detail = ep.ending(diverged)
        traj = replace(
            traj,
            stop_reason=reason,
            stop_detail=detail,
            deadline=ep.deadline if reason == StopReason.TIMEOUT else None,
            reward=math.nan if ep.reward is None or reason.is_infra_error else ep.reward,
        )
        traj.check()
        return JSONResponse(traj.to_dict())

    async def _reward(self, request: Request) -> JSONResponse:
        try:
            ep = self._episode(request)
            body = await self._json(request)
            reward = body.get("reward") if isinstance(body, dict) else None
            if (
                isinstance(reward, bool)
                or not isinstance(reward, int | float)
                or not math.isfinite(reward)
            ):
                raise APIError(400, 'body: {"reward": a finite number}', param="reward")
            ep.reward = float(reward)
            if self.on_done is not None:
                self.on_done(ep)
            return JSONResponse({"id": ep.id, "reward": ep.reward})
        except APIError as e:
            return e.response()

    async def _end(self, request: Request) -> JSONResponse:
        try:
            ep = self._episode(request)
        except APIError as e:
            return e.response()
        self.remove(ep.id)
        if self.on_done is not None:
            self.on_done(ep)
        return JSONResponse({"id": ep.id, "deleted": True})

    @contextlib.asynccontextmanager
    async def serving(
        self, host: str = "127.0.0.1", port: int = 0, *, allowed_hosts: tuple[str, ...] = ()
    ) -> AsyncIterator[str]:
        """Serve on this event loop while the block runs; yields the base URL (port 0: any free
        port). On a loopback `host`, requests must name a loopback Host or one of `allowed_hosts`
        (a reverse proxy's). `self.effective` holds the limits in effect. Signals are left to the
        host program (the training run handles its own)."""
        if self.token is None and not is_loopback(host):
            raise ValueError(
                f"refusing to bind {host} without a token: anyone who reaches it could "
                "sample from the policy and write into its episodes"
            )
        self._hosts.loopback_only = is_loopback(host)
        self._hosts.allowed = frozenset(h.lower() for h in allowed_hosts)
        async with serve_app(self.app, host, port, self.limits) as (base, self.effective):
            yield base


def _refusal(status: int, message: str, code: str, path: str) -> Response:
    """Auth's 401 or 421, in the shape of the API `path` belongs to (Anthropic's for
    `/v1/messages`, OpenAI's otherwise)."""
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    error = APIError(status, message, code=code, kind=kind)
    return anthropic.error_response(error) if path.endswith("/v1/messages") else error.response()


def episode_urls(ep: EndpointEpisode, base: str) -> dict[str, str]:
    """Where an episode's clients point, and the key they send: `base_url` for OpenAI's (Chat
    Completions, Responses), `anthropic_base_url` for Anthropic's (which adds /v1/messages
    itself), `api_key` the episode's own (good for its calls and nothing else)."""
    return {
        "id": ep.id,
        "base_url": f"{base}/episodes/{ep.id}/v1",
        "anthropic_base_url": f"{base}/episodes/{ep.id}",
        "api_key": ep.token,
    }
