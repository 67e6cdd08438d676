"""Test doubles: a scripted engine that returns pre-written turns as token ids."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

from agentgrpo.engine.base import Completion, EngineError, SamplingParams


class ScriptedEngine:
    """Returns scripted assistant turns (text, tokenized once) with deterministic fake logprobs.

    `script(prompt_ids, call_index) -> str | Exception`; the text is encoded and the end-of-turn id
    appended unless the text already ends with it or another stop token of the request (a template
    with several end-of-turn tokens). `delay_s` (seconds, or a function of the call
    index) simulates generation time; `max_in_flight` records the most concurrent requests. Logprobs
    are fixed negative numbers so tests can check they land in the trajectory unchanged.
    """

    def __init__(
        self,
        tokenizer,
        script: Callable[[list[int], int], str | Exception] | Sequence[str],
        eot_id: int,
        *,
        delay_s: float | Callable[[int], float] = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = (
            script if callable(script) else (lambda _ids, i, s=list(script): s[i % len(s)])
        )
        self.eot_id = eot_id
        self.calls: list[list[int]] = []
        self.delay_s = delay_s if callable(delay_s) else (lambda _i, d=delay_s: d)
        self.version = "v0"
        self.in_flight = 0
        self.max_in_flight = 0  # most requests inside generate at once

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        i = len(self.calls)
        self.calls.append(list(prompt_ids))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if delay := self.delay_s(i):
                await asyncio.sleep(delay)
        finally:
            self.in_flight -= 1
        out = self.script(prompt_ids, i)
        if isinstance(out, Exception):
            raise out
        ids = self.tokenizer.encode(out, add_special_tokens=False)
        finish = "stop"
        if not ids or (ids[-1] != self.eot_id and ids[-1] not in params.stop_token_ids):
            ids.append(self.eot_id)
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        rng = random.Random(len(prompt_ids) * 7919 + i)
        return Completion(
            token_ids=ids,
            logprobs=[-rng.uniform(0.01, 3.0) for _ in ids],
            finish_reason=finish,
            weight_version=self.version,
        )

    async def update_weights(self, weights, *, version: str) -> None:
        self.version = version


class FailingEngine(ScriptedEngine):
    async def generate(self, prompt_ids, params):
        raise EngineError("server unreachable after 3 retries")
