"""SGLang's `/generate` wire format as pure functions: request bodies in, `Completion`s out.

Split from the client (`client.py`: requests and weight updates; `engine/pool.py`: balancing and
retries) so the protocol can be read and tested on its own. Every response shape in
`tests/data/sglang/` (old and new versions) is parsed here; see docs/serving.md
for what each field means.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agentgrpo.engine.base import Completion, EngineError, SamplingParams
from agentgrpo.engine.pool import error_message  # noqa: F401 - SGLang's error bodies are read so

_FINISH_TYPES = frozenset({"stop", "length", "abort"})
# "... the model's maximum context length of {C} tokens ..." (prompt + max_new_tokens) and
# "... longer than the model's context length ({C} tokens)." (the prompt alone)
_CONTEXT_OF = re.compile(r"context length (?:of |\()(\d+) tokens")


def parse_generate_output(
    obj: Mapping[str, Any], *, weight_version: str | None = None
) -> Completion:
    """Turn one `/generate` output object into a `Completion`.

    Tolerates every shape in the fixtures: HEAD and v0.5.x meta keys (unknown keys ignored),
    v0.4.x without `output_ids`, `--skip-tokenizer-init` without `text`, and a bare `meta_info`
    object. `weight_version` is the fallback for servers older than v0.5.2, whose meta_info has
    none. Raises `EngineError` when the output cannot be trusted (no logprobs, ids disagree).
    """
    meta = obj.get("meta_info")
    if meta is None:
        if "finish_reason" not in obj:
            raise EngineError(f"SGLang output has no meta_info: keys {sorted(obj)}")
        meta = obj  # some shapes put the meta keys at the top level
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineError(
            "SGLang output has no output_token_logprobs (was return_logprob dropped by a proxy?)"
        )
    try:
        token_ids = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
    except (TypeError, ValueError, IndexError) as e:  # a null logprob or a malformed tuple
        raise EngineError(f"malformed output_token_logprobs from SGLang: {e}") from e
    output_ids = obj.get("output_ids")
    if output_ids is not None and list(output_ids) != token_ids:
        raise EngineError(
            f"SGLang output_ids {list(output_ids)[:8]}... disagree with the ids of "
            f"output_token_logprobs {token_ids[:8]}..."
        )
    finish = meta.get("finish_reason")
    if isinstance(finish, str):  # OpenAI-style string
        ftype, finish = finish, {}
    elif isinstance(finish, Mapping):
        ftype = finish.get("type")
    else:
        raise EngineError(f"SGLang output without a finish_reason: {finish!r}")
    if ftype not in _FINISH_TYPES:
        raise EngineError(f"unknown SGLang finish_reason type {ftype!r}")
    detail = ""
    if ftype == "abort":
        detail = f"aborted by the server: {finish.get('message') or 'no message'}"
    meta_out = {
        "rid": meta.get("id"),
        "prompt_tokens": meta.get("prompt_tokens"),
        "cached_tokens": meta.get("cached_tokens"),
        "e2e_latency": meta.get("e2e_latency"),
    }
    if "matched" in finish:
        meta_out["matched"] = finish["matched"]
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=ftype,
        weight_version=meta.get("weight_version", weight_version),
        detail=detail,
        meta=meta_out,
    )


class StreamFold:
    """One streamed `/generate` request (`"stream": true`) folded into the output object of a
    non-streamed one, and the weight version of each sampled token.

    SGLang stamps every chunk it sends with `meta_info.weight_version`, the server's version when
    its tokenizer manager forwarded the chunk. The tokens a chunk adds are counted to that
    version, so a request paused across a weight update (`/pause_generation` mode `retract`) and
    continued reads as the tokens sampled before the update and those after (`version_runs`).
    Chunks are cumulative by default and deltas with `--incremental-streaming-output`; both are
    read, told apart by `completion_tokens`, which stays cumulative in both modes. Ids come from
    `output_token_logprobs` only (`output_ids` of a stream changed between cumulative and delta
    across SGLang versions).
    """

    def __init__(self) -> None:
        self.entries: list[Any] = []  # [logprob, id, text] per sampled token, in order
        self.runs: list[tuple[int, str | None]] = []  # (count, weight version) over `entries`
        self.last: Mapping[str, Any] | None = None  # the latest chunk

    def feed(self, chunk: Mapping[str, Any]) -> None:
        meta = chunk.get("meta_info")
        if not isinstance(meta, Mapping):
            raise EngineError(f"SGLang stream chunk without meta_info: keys {sorted(chunk)}")
        entries = meta.get("output_token_logprobs")
        total = meta.get("completion_tokens")
        if entries is None or total is None:
            raise EngineError(
                "SGLang stream chunk without output_token_logprobs or completion_tokens"
            )
        have = len(self.entries)
        if len(entries) == total >= have:  # cumulative (or the first chunk: both read alike)
            new = entries[have:]
        elif have + len(entries) == total:  # a delta
            new = entries
        else:
            raise EngineError(
                f"SGLang stream chunk with {len(entries)} output_token_logprobs and "
                f"completion_tokens {total} after {have} tokens: neither cumulative nor a delta"
            )
        if new:
            self.entries.extend(new)
            version = meta.get("weight_version")
            if self.runs and self.runs[-1][1] == version:
                self.runs[-1] = (self.runs[-1][0] + len(new), version)
            else:
                self.runs.append((len(new), version))
        self.last = chunk

    def output(self) -> dict[str, Any]:
        """The finished request as `parse_generate_output` reads it; `EngineError` when the
        stream ended before a chunk with a `finish_reason`."""
        last = self.last
        if last is None or not last["meta_info"].get("finish_reason"):
            raise EngineError("the SGLang stream ended before its request finished")
        meta = {**last["meta_info"], "output_token_logprobs": self.entries}
        return {"meta_info": meta}

    def version_runs(self, fallback: str | None) -> list[tuple[int, str | None]]:
        """(count, version) over the sampled tokens; `fallback` for chunks without a version
        (SGLang before 0.5.2)."""
        out: list[tuple[int, str | None]] = []
        for n, v in self.runs:
            v = fallback if v is None else v
            if out and out[-1][1] == v:
                out[-1] = (out[-1][0] + n, v)
            else:
                out.append((n, v))
        return out


def parse_generate_response(body: Any, *, weight_version: str | None = None) -> list[Completion]:
    """Parse a whole `/generate` body: one object, or a list (batch input or `n > 1`)."""
    items = body if isinstance(body, list) else [body]
    if not all(isinstance(i, Mapping) for i in items):
        raise EngineError(f"unexpected SGLang /generate body of type {type(body).__name__}")
    return [parse_generate_output(i, weight_version=weight_version) for i in items]


def is_context_length_error(message: str) -> bool:
    """True for SGLang's prompt-too-long validation errors (the only 400 we turn into a finish)."""
    m = message.lower()
    return "context length" in m or "context_length" in m


def context_length_of(message: str) -> int | None:
    """The context length C that SGLang's context-length 400 names, or None. Its rule
    (docs/serving.md, errors) is `prompt + max_new_tokens < C`."""
    m = _CONTEXT_OF.search(message)
    return int(m.group(1)) if m else None


def sampling_body(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """The `sampling_params` object: docs/serving.md's RL settings and known keys only."""
    sp: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 = whole vocabulary
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
    }
    if params.seed is not None:
        sp["sampling_seed"] = params.seed  # SGLang >= 0.5.9; checked against the server version
    return sp


def score_body(
    prompt_ids: list[int], completion_ids: list[int], temperature: float
) -> dict[str, Any]:
    """The `/generate` body whose prompt logprobs (section 1.4) score `completion_ids` after
    `prompt_ids`; `score_result` reads the answer."""
    if not prompt_ids or not completion_ids:
        raise ValueError("score() needs a non-empty prompt and completion")
    return {
        "rid": "",
        "input_ids": list(prompt_ids) + list(completion_ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": temperature},
        "return_logprob": True,
        "logprob_start_len": len(prompt_ids)
        - 1,  # one position early: SGLang nulls the first entry
        "stream": False,
    }


def score_result(raw: dict[str, Any], body: dict[str, Any]) -> list[float]:
    """The completion's logprobs from the answer to `score_body`."""
    n, start = len(body["input_ids"]), body["logprob_start_len"]
    meta = raw.get("meta_info", raw)
    entries = meta.get("input_token_logprobs") or []
    if len(entries) != n - start:
        raise EngineError(
            f"SGLang returned {len(entries)} prompt logprobs for logprob_start_len={start} "
            f"and {n} input ids (expected {n - start})"
        )
    try:
        return [float(e[0]) for e in entries[1:]]
    except (TypeError, ValueError) as e:  # trust boundary: a null where a value belongs
        raise EngineError(f"malformed input_token_logprobs from SGLang: {e}") from e


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
