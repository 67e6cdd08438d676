"""vLLM's token-in/token-out route (`POST /inference/v1/generate`) as pure functions: request bodies
in, `Completion`s out. docs/serving.md says what each field means and which server flags the
client needs (`--enable-scale-out`, `--logprobs-mode processed_logprobs`).

The route takes `token_ids` and vLLM's own `SamplingParams` as a JSON object, and answers with the
sampled `token_ids`, their logprobs (`logprobs.content`, one entry with `token_id` per token), the
finish reason, the matched stop token (`stop_reason`) and `weight_versions`: spans of output
positions, each with the server's weight version when those tokens were sampled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agentgrpo.engine.base import Completion, EngineError, SamplingParams

_FINISH = frozenset({"stop", "length", "abort"})
# "The decoder prompt (length 2049) is longer than the maximum model length of 2048. ..." and the
# OpenAI routes' "This model's maximum context length is 2048 tokens. ..."
_CONTEXT_OF = re.compile(r"maximum (?:model|context) length (?:of |is )(\d+)")


def sampling_body(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """vLLM `SamplingParams` for one rollout request: only the sampled token's logprob (the
    server's `--logprobs-mode processed_logprobs` makes it the tempered distribution's), no text
    (the client never reads any), stop ids kept in the output (vLLM keeps a matched stop id)."""
    sp: dict[str, Any] = {
        "max_tokens": max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else 0,  # vLLM: 0 = whole vocabulary
        "stop_token_ids": list(params.stop_token_ids),
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if params.seed is not None:
        sp["seed"] = params.seed
    return sp


def generate_body(prompt_ids: list[int], params: SamplingParams, max_new: int) -> dict[str, Any]:
    """The body of one generate request (the pool sets a fresh `request_id` per attempt)."""
    return {
        "request_id": "",
        "token_ids": list(prompt_ids),
        "sampling_params": sampling_body(params, max_new),
        "output_mode": "tokens",
    }


def parse_generate_response(
    obj: Mapping[str, Any], *, weight_version: str | None = None
) -> Completion:
    """Turn one `/inference/v1/generate` answer into a `Completion`.

    `weight_version` is the fallback for an answer without `weight_versions` spans. Raises
    `EngineError` when the answer cannot be trusted (no logprobs, ids that disagree, spans that
    do not cover the output)."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        raise EngineError(f"vLLM answer without exactly one choice: keys {sorted(obj)}")
    choice = choices[0]
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise EngineError("vLLM answer without logprobs (was sampling_params.logprobs dropped?)")
    try:
        logprobs = [float(e["logprob"]) for e in content]
        ids = [int(e["token_id"]) for e in content]
    except (KeyError, TypeError, ValueError) as e:  # trust boundary: a malformed entry
        raise EngineError(f"malformed logprobs from vLLM: {e!r}") from e
    if ids != token_ids:
        raise EngineError(
            f"vLLM token_ids {token_ids[:8]}... disagree with the ids of its logprobs {ids[:8]}..."
        )
    finish = choice.get("finish_reason")
    if finish not in _FINISH:
        raise EngineError(f"unknown vLLM finish_reason {finish!r}")
    runs = version_runs(choice.get("weight_versions"), len(token_ids), weight_version)
    version = runs[-1][1] if runs else weight_version
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish,
        weight_version=version,
        detail="aborted by the server" if finish == "abort" else "",
        meta={"rid": obj.get("request_id"), "matched": choice.get("stop_reason")},
        version_runs=runs if len(runs) > 1 else None,
    )


def version_runs(spans: Any, n_tokens: int, fallback: str | None) -> list[tuple[int, str | None]]:
    """(count, version) runs over the output from vLLM's `weight_versions` spans (`version`,
    `start`, `end` over output positions); one run of `fallback` when there are none."""
    if not spans:
        return [(n_tokens, fallback)] if n_tokens else []
    out: list[tuple[int, str | None]] = []
    pos = 0
    for span in spans:
        start, end, version = int(span["start"]), int(span["end"]), str(span["version"])
        if start != pos or end < start:
            raise EngineError(f"vLLM weight_versions spans leave a gap or overlap: {spans}")
        if end > start:
            if out and out[-1][1] == version:
                out[-1] = (out[-1][0] + end - start, version)
            else:
                out.append((end - start, version))
        pos = end
    if pos != n_tokens:
        raise EngineError(f"vLLM weight_versions cover {pos} of {n_tokens} output tokens: {spans}")
    return out


def is_context_length_error(message: str) -> bool:
    """True for vLLM's prompt-too-long validation errors (the only 400 turned into a finish)."""
    m = message.lower()
    return "maximum model length" in m or "maximum context length" in m


def context_length_of(message: str) -> int | None:
    """The context window a vLLM context-length error names, or None."""
    m = _CONTEXT_OF.search(message)
    return int(m.group(1)) if m else None


def score_body(
    prompt_ids: list[int], completion_ids: list[int], temperature: float
) -> dict[str, Any]:
    """The generate body whose prompt logprobs score `completion_ids` after `prompt_ids`. vLLM's
    prompt logprobs never see the temperature (they skip the sampler), so only 1 is offered."""
    if not prompt_ids or not completion_ids:
        raise ValueError("score() needs a non-empty prompt and completion")
    if temperature != 1.0:
        raise ValueError(f"vLLM scores at temperature 1 only (prompt logprobs), got {temperature}")
    return {
        "request_id": "",
        "token_ids": list(prompt_ids) + list(completion_ids),
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False},
        "output_mode": "tokens",
    }


def score_result(raw: Mapping[str, Any], body: Mapping[str, Any], start: int) -> list[float]:
    """The logprobs of the tokens from position `start` on, from the answer to `score_body`:
    `prompt_logprobs[i]` maps the id of prompt token i to its logprob (None for the first)."""
    ids = body["token_ids"]
    entries = raw.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = len(entries) if isinstance(entries, list) else entries
        raise EngineError(f"vLLM returned {got} prompt logprobs for {len(ids)} prompt tokens")
    try:
        return [float(entries[i][str(ids[i])]["logprob"]) for i in range(start, len(ids))]
    except (KeyError, TypeError, ValueError) as e:  # trust boundary: a missing or null entry
        raise EngineError(f"malformed prompt_logprobs from vLLM: {e!r}") from e
