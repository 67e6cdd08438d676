"""Rewards that need judgement: an LLM judge behind any OpenAI-compatible endpoint, or a
reward-model server, as verifiers for a `Rubric`.

`JudgeVerifier` asks a chat model to score a trajectory against a rubric and answer as JSON
(`{"explanation", "score"}`); with `group=True` it ranks a whole group in one call (ART's RULER
idea), through the Rubric's `score_group`. `RewardModelVerifier` posts the conversation to a
reward model's score endpoint (vLLM's `/classify`, or any that answers JSON).

Both bound, time out, retry with backoff and cache their requests. A judge that still fails gives
NaN (unscorable), never 0. What was asked and answered is the result's `info`, which a Rubric
keeps in the trajectory's `Score.info`. Details: docs/environments.md, "Judges and reward models".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.env.rubric import VerifierResult
from agentgrpo.types import Message, Task, Trajectory

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


class RemoteConfig(BaseModel):
    """How a remote scorer is reached, bounded and retried."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(description="the server, e.g. http://127.0.0.1:8000/v1")
    model: str = Field("judge", description="the model name sent with each request")
    api_key_env: str | None = Field(
        None, description="the environment variable holding the API key (never the key itself)"
    )
    max_concurrency: int = Field(8, ge=1, description="requests in flight at once")
    timeout_s: float = Field(60.0, gt=0, description="deadline of one request")
    retries: int = Field(2, ge=0, description="further attempts after a failed one")
    backoff_s: float = Field(1.0, ge=0, description="wait before the first retry, doubled after")
    cache_size: int = Field(10_000, ge=0, description="answers kept by content (0: no cache)")


class JudgeConfig(RemoteConfig):
    """An LLM judge: what it is asked and how its answer is read."""

    rubric: str = Field(description="the criteria the judge scores against, in plain words")
    group: bool = Field(
        False, description="rank a whole group in one call (RULER) instead of one call each"
    )
    max_score: float = Field(1.0, gt=0, description="scores run from 0 to this; divided by it")
    response_format: Literal["json_schema", "json_object", "text"] = Field(
        "json_schema",
        description="structured output asked of the server; text for one without it "
        "(serve-policy): the JSON is then read from the reply's text",
    )
    temperature: float = Field(0.0, ge=0, description="the judge's sampling temperature")
    max_tokens: int = Field(512, ge=1, description="most tokens of one answer")


class RewardModelConfig(RemoteConfig):
    """A reward-model server: where its score is in the reply."""

    path: str = Field("/classify", description="the score endpoint, after base_url")
    send: Literal["messages", "text"] = Field(
        "messages",
        description="the conversation as chat messages (the server applies its template) or as "
        "one text of role-prefixed lines, in the `input` field",
    )
    score_path: str = Field(
        "data.0.probs.-1",
        description="where the score is in the JSON reply: keys and list indices, dotted",
    )


class JudgeUnavailable(RuntimeError):
    """The judge or reward model could not be asked or read, after its retries; `answer` is the
    last answer it gave (raw), when it gave one."""

    def __init__(self, message: str, answer: str | None = None) -> None:
        super().__init__(message)
        self.answer = answer


class _Remote:
    """What both scorers share: bounded concurrency, retries with backoff, a cache by content."""

    def __init__(self, cfg: RemoteConfig) -> None:
        self.cfg = cfg
        self.headers = {}
        if cfg.api_key_env is not None:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ValueError(f"{type(self).__name__}: ${cfg.api_key_env} is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.calls = 0  # requests sent (cache hits are not), for cost accounting

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.cfg.max_concurrency)
        return self._slots[loop]

    async def _ask(self, path: str, body: dict[str, Any], read: Any) -> tuple[Any, str, bool, int]:
        """`read(reply_json)` of POST base_url+path: (what it read, the raw answer, whether it came
        from the cache, attempts). `read` raises ValueError for an answer worth asking again."""
        key = hashlib.sha256(json.dumps([path, body], sort_keys=True).encode()).hexdigest()
        if key in self._cache:
            self._cache.move_to_end(key)
            value, raw = self._cache[key]
            return value, raw, True, 0
        url, why, delay = self.cfg.base_url.rstrip("/") + path, "", self.cfg.backoff_s
        raw: str | None = None
        for attempt in range(1, self.cfg.retries + 2):
            if attempt > 1:
                await asyncio.sleep(delay)
                delay *= 2
            try:
                async with self._slot(), httpx.AsyncClient(timeout=self.cfg.timeout_s) as http:
                    self.calls += 1
                    r = await http.post(url, json=body, headers=self.headers)
                if r.status_code != 200:
                    why = f"{url} answered {r.status_code}: {r.text[:300]}"
                    if r.status_code in RETRY_STATUS:
                        continue
                    raise JudgeUnavailable(why)
                raw = r.text
                value = read(r.json())
            except (httpx.HTTPError, OSError) as e:  # transport: the server, not the trajectory
                why = f"{url}: {type(e).__name__}: {e}"
                continue
            except ValueError as e:  # an answer that does not parse (or JSON that is not)
                why = f"the answer did not parse: {e}"
                continue
            if self.cfg.cache_size:
                self._cache[key] = (value, raw)
                while len(self._cache) > self.cfg.cache_size:
                    self._cache.popitem(last=False)
            return value, raw, False, attempt
        raise JudgeUnavailable(f"after {self.cfg.retries + 1} attempts: {why}", raw)


def render(messages: Sequence[Message]) -> str:
    """A conversation as text for a judge to read: one block per message, tool calls as JSON."""
    blocks = []
    for m in messages:
        text = m.content
        for call in m.tool_calls or []:
            text += f"\n[calls {call.name} with {json.dumps(call.arguments, sort_keys=True)}]"
        blocks.append(f"[{m.role}{f' {m.name}' if m.name else ''}]\n{text}")
    return "\n\n".join(blocks)


_SCORE = {"type": "number"}
_ONE = {
    "type": "object",
    "properties": {"explanation": {"type": "string"}, "score": _SCORE},
    "required": ["explanation", "score"],
    "additionalProperties": False,
}
_MANY = {
    "type": "object",
    "properties": {
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, **_ONE["properties"]},
                "required": ["id", "explanation", "score"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["scores"],
    "additionalProperties": False,
}


def _json_in(text: str) -> Any:
    """The JSON object in a reply: all of it, or its first `{...}` span (a fenced block, or JSON
    after some words: what a model without structured output writes)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        found = re.search(r"\{.*\}", text, re.DOTALL)
        if found is None:
            raise ValueError(f"no JSON object in {text[:200]!r}") from None
        return json.loads(found.group(0))  # JSONDecodeError is a ValueError


class JudgeVerifier(_Remote):
    """An LLM judge as a verifier: `(trajectory, task) -> VerifierResult` in [0, 1], NaN when the
    judge fails. With `group=True` it scores a group in one call (`score_group`).

    Example (an env declares `rubric = ...`; the judge is first asked when a group is scored):
        >>> from agentgrpo.env.rubric import Rubric
        >>> from agentgrpo.verify.judge import JudgeVerifier
        >>> def correct(trajectory, task):
        ...     return float(str(task.answer) in trajectory.messages[-1].content)
        >>> judge = JudgeVerifier(base_url="http://127.0.0.1:8000/v1", model="judge",
        ...                       rubric="1 for a polite, correct answer; 0 for a wrong one")
        >>> rubric = Rubric([("correct", correct, 1.0), ("judge", judge, 0.5)])
    """

    def __init__(self, config: JudgeConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config if config is not None else JudgeConfig(**kwargs))
        self.cfg: JudgeConfig

    @property
    def scores_groups(self) -> bool:
        return self.cfg.group

    def _request(self, user: str, schema: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        system = (
            "You are a judge of an AI assistant's work. Score it against the rubric below, "
            f"from 0 (worst) to {cfg.max_score:g} (best). Answer with JSON only, matching this "
            f"schema: {json.dumps(schema)}\n\nRubric:\n{cfg.rubric}"
        )
        body: dict[str, Any] = {
            "model": cfg.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens,
        }
        if cfg.response_format == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "judgement", "schema": schema, "strict": True},
            }
        elif cfg.response_format == "json_object":
            body["response_format"] = {"type": "json_object"}
        return body

    def _score(self, item: Any) -> tuple[float, str]:
        if not isinstance(item, dict) or not isinstance(item.get("score"), int | float):
            raise ValueError(f"no numeric score in {str(item)[:200]}")
        score = float(item["score"])
        if not 0 <= score <= self.cfg.max_score:
            raise ValueError(f"score {score} outside [0, {self.cfg.max_score:g}]")
        return score / self.cfg.max_score, str(item.get("explanation", ""))

    @staticmethod
    def _task_text(task: Task) -> str:
        text = f"Task:\n{render(task.prompt_messages())}"
        if task.answer is not None:
            text += f"\n\nReference answer: {task.answer}"
        return text

    @staticmethod
    def _answer(reply: dict[str, Any]) -> str:
        try:
            return reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"not a chat completion: {e!r}") from None

    async def __call__(self, trajectory: Trajectory, task: Task) -> VerifierResult:
        if self.cfg.group:
            return (await self.score_group([trajectory], task))[0]
        reply = render(trajectory.messages)
        body = self._request(f"{self._task_text(task)}\n\nThe assistant's episode:\n{reply}", _ONE)
        t0 = time.perf_counter()
        record: dict[str, Any] = {"kind": "judge", "model": self.cfg.model}
        record["prompt"] = body["messages"]
        try:
            (score, why), raw, cached, attempts = await self._ask(
                "/chat/completions", body, lambda r: self._score(_json_in(self._answer(r)))
            )
        except JudgeUnavailable as e:
            record.update(error=str(e), answer=e.answer, wall_s=round(time.perf_counter() - t0, 3))
            return VerifierResult(math.nan, f"judge failed: {e}", info=record)
        wall = round(time.perf_counter() - t0, 3)
        record.update(answer=raw, score=score, cached=cached, attempts=attempts, wall_s=wall)
        return VerifierResult(score, why, info=record)

    async def score_group(
        self, trajectories: Sequence[Trajectory], task: Task
    ) -> list[VerifierResult]:
        """Every trajectory of the group scored in one call, relative to the others."""
        n = len(trajectories)
        episodes = "\n\n".join(
            f"=== Episode {i} ===\n{render(t.messages)}" for i, t in enumerate(trajectories, 1)
        )
        user = (
            f"{self._task_text(task)}\n\n{n} attempts at this task follow. Score each one "
            f"(ids 1 to {n}) relative to the others: the better an attempt, the higher.\n\n"
            f"{episodes}"
        )
        body = self._request(user, _MANY)

        def read(reply: dict[str, Any]) -> dict[int, tuple[float, str]]:
            items = _json_in(self._answer(reply)).get("scores")
            if not isinstance(items, list):
                raise ValueError("no list of scores")
            scored = {item.get("id"): self._score(item) for item in items if isinstance(item, dict)}
            if set(scored) != set(range(1, n + 1)):
                raise ValueError(f"scores for ids {sorted(scored, key=str)}, not 1..{n}")
            return scored

        t0 = time.perf_counter()
        asked = {"kind": "judge", "model": self.cfg.model, "prompt": body["messages"]}
        try:
            scored, raw, cached, attempts = await self._ask("/chat/completions", body, read)
        except JudgeUnavailable as e:
            failed = asked | {"error": str(e), "answer": e.answer}
            why = f"judge failed: {e}"
            return [VerifierResult(math.nan, why, info=failed | {"id": i}) for i in range(1, n + 1)]
        wall = round(time.perf_counter() - t0, 3)
        out = []
        for i in range(1, n + 1):
            score, why = scored[i]
            record = asked | {"answer": raw, "id": i, "score": score, "cached": cached}
            record.update(attempts=attempts, wall_s=wall)
            out.append(VerifierResult(score, why, info=record))
        return out


def _at(data: Any, path: str) -> Any:
    for part in path.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


class RewardModelVerifier(_Remote):
    """A reward model's score of the conversation as a verifier; NaN when the server fails.

    Example (the server is first asked when a trajectory is scored):
        >>> from agentgrpo.verify.judge import RewardModelVerifier
        >>> rm = RewardModelVerifier(base_url="http://127.0.0.1:8001", model="my-rm",
        ...                          score_path="data.0.probs.1")
    """

    def __init__(self, config: RewardModelConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config if config is not None else RewardModelConfig(**kwargs))
        self.cfg: RewardModelConfig

    def _read(self, reply: Any) -> float:
        try:
            value = _at(reply, self.cfg.score_path)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise JudgeUnavailable(f"no score at {self.cfg.score_path!r}: {e!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isinf(value):
            raise JudgeUnavailable(f"{self.cfg.score_path!r} holds {value!r}, not a number")
        return float(value)

    async def __call__(self, trajectory: Trajectory, task: Task) -> VerifierResult:
        body: dict[str, Any] = {"model": self.cfg.model}
        if self.cfg.send == "messages":
            body["messages"] = [m.to_dict() for m in trajectory.messages]
        else:
            body["input"] = [render(trajectory.messages)]
        record: dict[str, Any] = {"kind": "reward model", "model": self.cfg.model}
        try:
            score, raw, cached, _ = await self._ask(self.cfg.path, body, self._read)
        except JudgeUnavailable as e:
            return VerifierResult(
                math.nan, f"reward model failed: {e}", info=record | {"error": str(e)}
            )
        record.update(score=score, answer=raw[:2000], cached=cached)
        return VerifierResult(score, info=record)
