"""Learner -> engine weight sync: versioned, time-bounded, verified.

The training loop calls `await sync.push(model, step)` after each optimizer step. The weights move
in process (`LocalEngine`), through safetensors in a shared directory (`disk`), or by a broadcast
in a process group of this process and every server GPU (`distributed`: NCCL, or gloo on a CPU).
A distributed push needs every server, so one out of rotation is probed first and the push fails
at once naming it if it does not come back. Every push has a deadline, sets the weight version
`str(step)`, and is verified: the engine's logprobs of a probe sequence must match the learner's
within `probe_tolerance` (`ProbeMismatchError` otherwise), on every server in rotation.
`push()` must run on the process that holds the full, unwrapped HF model (rank 0; gather FSDP
shards and merge LoRA adapters first). docs/many-gpus.md has the details of each method.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import save_file

from agentgrpo.engine.base import EngineError


class WeightSyncError(EngineError):
    """A weight sync failed or did not finish in time (after the engine's own retries)."""


class ProbeMismatchError(WeightSyncError):
    """The engine's logprobs on the probe sequence differ from the learner's after a sync."""


class WeightSyncConfig(BaseModel):
    """How the learner's weights reach the inference engine after each optimizer step."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["auto", "in_process", "disk", "distributed"] = Field(
        "auto",
        description="auto = in_process for in-process engines; for SGLang, disk when shared_dir "
        "is set, else distributed.",
    )
    timeout_s: float = Field(
        600.0, gt=0, description="Deadline of one push, verification included."
    )
    shared_dir: str | None = Field(
        None, description="disk: a directory every server reads under the same path."
    )
    keep_last: int = Field(
        2, ge=1, description="disk: how many pushed checkpoints to keep (older ones are deleted)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the pushed weights; auto = the model's own."
    )
    master_address: str = Field(
        "127.0.0.1",
        description="distributed: this machine's address as the servers reach it (rank 0 hosts "
        "the rendezvous store there).",
    )
    master_port: int = Field(0, ge=0, lt=65536, description="distributed: 0 = a free port.")
    backend: Literal["nccl", "gloo"] = Field(
        "nccl", description="distributed: nccl between GPUs; gloo for CPU tensors (tests)."
    )
    group_name: str = Field("agentgrpo_weight_sync", description="distributed: process group name.")
    bucket_mb: float = Field(
        512.0, gt=0, description="distributed: tensors per update call, at most this many MB."
    )
    probe_every: int = Field(1, ge=0, description="Verify every N-th push; 0 = never verify.")
    probe_tolerance: float = Field(
        0.05, ge=0, description="Largest allowed mean |engine - learner| logprob on the probe."
    )


def sequence_logprobs(model: torch.nn.Module, token_ids: list[int], start: int = 1) -> list[float]:
    """Per-token logprobs of `token_ids[start:]` under `model` at temperature 1.

    Entry i is log p(token_ids[start + i] | token_ids[:start + i]). The model runs in eval mode
    (no dropout) without gradients; its train/eval mode is restored afterwards.
    """
    if not 1 <= start < len(token_ids):
        raise ValueError(f"start must be in [1, {len(token_ids)}), got {start}")
    param = next(model.parameters())
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids_1T = torch.tensor([token_ids], device=param.device)
            logits_TV = model(ids_1T).logits[0, start - 1 : -1].float()
            logp_TV = torch.log_softmax(logits_TV, dim=-1)
            target_T = ids_1T[0, start:]
            return logp_TV.gather(-1, target_T[:, None])[:, 0].tolist()
    finally:
        model.train(was_training)


def default_probe(vocab_size: int, length: int = 16) -> list[int]:
    """A fixed pseudo-random probe sequence (the same on every run)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def join_weight_update_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> Any:
    """Create the named weight-update process group next to any default group of this process.

    torch.distributed has one default group per process; the learner may already have one
    (accelerate/FSDP). SGLang's servers join a *second* group, built from a TCP rendezvous store
    prefixed with the group name: this does the same on the trainer side, so both ends agree.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _beside(
    call: asyncio.Future[Any], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """Run the trainer's blocking side of a collective (`fn`: the rendezvous, a broadcast) in a
    daemon thread while the servers' HTTP `call` is pending; `fn`'s result once both succeeded.

    The first failure of either side is raised at once, the servers' when both failed: a server
    that refuses (a 400 at once) leaves the trainer's side blocked until its own timeout, and what
    the server said is the reason. That thread cannot be stopped; as a daemon it holds up neither
    this push nor the interpreter's exit, and its late failure is dropped.
    """
    loop = asyncio.get_running_loop()
    side: asyncio.Future[Any] = loop.create_future()
    side.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: never logged

    def settle(result: Any, error: BaseException | None) -> None:
        if side.done():
            return
        if error is not None:
            side.set_exception(error)
        else:
            side.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the event loop, raised there
            error = e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for this side any more
            pass

    threading.Thread(target=run, name="agentgrpo-weight-sync", daemon=True).start()
    try:
        await asyncio.wait({call, side}, return_when=asyncio.FIRST_EXCEPTION)
        for f in (call, side):
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()
        return side.result()
    finally:
        call.cancel()  # a no-op once it is done


def _buckets(
    named: list[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class WeightSync:
    """Pushes the learner's weights to an engine after each step and verifies them.

    Example:
        ```python
        sync = WeightSync(engine, WeightSyncConfig(shared_dir="/mnt/nfs/agentgrpo-weights"))
        for step in range(1, steps + 1):
            ...                                        # rollouts, learner.train_step(...)
            version = await sync.push(model, step)     # later completions carry `version`
        await sync.close()
        ```

    `probe_ids`: the token ids scored after each push (default: 16 fixed pseudo-random ids).
    """

    def __init__(
        self,
        engine: Any,
        cfg: WeightSyncConfig | None = None,
        *,
        probe_ids: list[int] | None = None,
    ) -> None:
        self.engine = engine
        self.cfg = cfg = cfg or WeightSyncConfig()
        method = cfg.method
        is_remote = hasattr(engine, "update_weights_from_disk")
        if method == "auto":
            method = ("disk" if cfg.shared_dir else "distributed") if is_remote else "in_process"
        if method in ("disk", "distributed") and not is_remote:
            raise ValueError(
                f"method {method!r} needs a server engine (SGLang, vLLM), got "
                f"{type(engine).__name__}"
            )
        if method == "disk" and not cfg.shared_dir:
            raise ValueError("method 'disk' needs shared_dir (a directory every server can read)")
        if cfg.probe_every and not hasattr(engine, "score"):
            raise ValueError(
                f"{type(engine).__name__} has no score(); verification needs it (probe_every=0 "
                "turns verification off)"
            )
        if probe_ids is not None and len(probe_ids) < 2:
            raise ValueError("probe_ids needs at least 2 tokens")
        self.method: str = method
        self.probe_ids = probe_ids
        self.version: str | None = None
        self.last_probe_error: float | None = None  # mean |diff| of the last push's verification
        self._last_step: int | None = None
        self._pushes = 0
        self._pushed_dirs: deque[Path] = deque()
        self._pg: Any = None

    async def push(self, model: torch.nn.Module, step: int) -> str:
        """Send `model`'s weights to the engine as version `str(step)`, verify, return the version.

        Raises `WeightSyncError` when the sync does not finish within `timeout_s` or a server
        reports another version, the engine's `EngineError` (naming the server and its answer)
        when a server refuses the update or cannot take part, and `ProbeMismatchError` when the
        engine's probe logprobs differ from the learner's; all are `EngineError`s.
        """
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step must increase: got {step} after {self._last_step}")
        version = str(step)
        self.last_probe_error = None  # set again by this push's verification, if it probes
        try:
            await asyncio.wait_for(self._push(model, step, version), timeout=self.cfg.timeout_s)
        except asyncio.TimeoutError as e:
            raise WeightSyncError(
                f"weight sync of step {step} ({self.method}) did not finish within "
                f"{self.cfg.timeout_s:.0f}s"
            ) from e
        self._last_step, self.version = step, version
        return version

    async def _push(self, model: torch.nn.Module, step: int, version: str) -> None:
        if self.method == "in_process":
            await self.engine.update_weights(self._state_dict(model, clone=True), version=version)
        elif self.method == "disk":
            await self._push_disk(model, step, version)
        else:
            await self._push_distributed(model, version)
        self._pushes += 1
        if hasattr(self.engine, "weight_versions"):
            versions = await self.engine.weight_versions()
            stale = {u: v for u, v in versions.items() if v != version}
            if stale:
                raise WeightSyncError(
                    f"servers report another weight version than {version}: {stale}"
                )
        if self.cfg.probe_every and self._pushes % self.cfg.probe_every == 0:
            await self.verify(model, version=version)

    def _dtype(self, model: torch.nn.Module) -> torch.dtype | None:
        return None if self.cfg.dtype == "auto" else getattr(torch, self.cfg.dtype)

    def _state_dict(self, model: torch.nn.Module, *, clone: bool) -> dict[str, torch.Tensor]:
        dtype = self._dtype(model)
        out = {}
        for name, t in model.state_dict().items():
            t = t.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[name] = t.clone() if clone else t
        return out

    async def _push_disk(self, model: torch.nn.Module, step: int, version: str) -> None:
        root = Path(self.cfg.shared_dir or "")
        final = root / f"step_{step}"
        await asyncio.to_thread(self._save, model, final)
        await self.engine.update_weights_from_disk(final, version=version)
        self._pushed_dirs.append(final)
        while len(self._pushed_dirs) > self.cfg.keep_last:  # never the one the servers now serve
            shutil.rmtree(self._pushed_dirs.popleft(), ignore_errors=True)

    def _save(self, model: torch.nn.Module, final: Path) -> None:
        """Write the checkpoint next to its final place, then rename it: a server never sees a
        half-written directory."""
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        sd = self._state_dict(model, clone=False)
        config = getattr(model, "config", None)
        untie = getattr(self.engine, "untied_checkpoints", False) and getattr(
            config, "tie_word_embeddings", False
        )
        if hasattr(model, "save_pretrained") and not untie:
            model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        else:
            tmp.mkdir()
            save_file(
                {k: v.contiguous().clone() if untie else v.contiguous() for k, v in sd.items()},
                str(tmp / "model.safetensors"),
                metadata={"format": "pt"},
            )
            if untie:  # the output projection as a tensor of its own (engine/vllm/client.py)
                untied = {**config.to_dict(), "tie_word_embeddings": False}
                (tmp / "config.json").write_text(json.dumps(untied, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)

    async def _push_distributed(self, model: torch.nn.Module, version: str) -> None:
        cfg = self.cfg
        engine = self.engine
        if self._pg is None:
            world_size = 1 + sum(await engine.gpus_per_server())
            port = cfg.master_port or _free_port(cfg.master_address)
            init = asyncio.ensure_future(
                engine.init_weights_update_group(
                    master_address=cfg.master_address,
                    master_port=port,
                    group_name=cfg.group_name,
                    backend=cfg.backend,
                )
            )
            # the trainer's end of the group: the engine's own (vLLM's communicator), else a
            # torch.distributed group beside the learner's (SGLang)
            join = getattr(engine, "trainer_join", join_weight_update_group)
            self._pg = await _beside(
                init,
                join,
                cfg.master_address,
                port,
                rank=0,
                world_size=world_size,
                group_name=cfg.group_name,
                backend=cfg.backend,
                timeout_s=cfg.timeout_s,
            )
        device = self._broadcast_device()
        named = [(n, t.to(device)) for n, t in self._state_dict(model, clone=False).items()]
        buckets = list(_buckets(named, int(cfg.bucket_mb * 2**20)))
        async with engine.paused(every_server=True):  # every rank of the group, or none
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                call = asyncio.ensure_future(
                    engine.update_weights_from_distributed(
                        [n for n, _ in bucket],
                        [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                        [list(t.shape) for _, t in bucket],
                        group_name=cfg.group_name,
                        version=version if last else None,
                    )
                )
                await _beside(call, self._broadcast, [t for _, t in bucket])

    def _broadcast_device(self) -> torch.device:
        """Where broadcast tensors live: this process's GPU for NCCL, the CPU for gloo."""
        if self.cfg.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        if (broadcast := getattr(self.engine, "trainer_broadcast", None)) is not None:
            broadcast(self._pg, tensors)
            return
        for t in tensors:
            dist.broadcast(t.contiguous(), src=0, group=self._pg)

    async def verify(self, model: torch.nn.Module, *, version: str | None = None) -> float:
        """Compare the engine's and the learner's logprobs on the probe; returns the mean |diff|
        (of the worst server when the engine has `score_each`, which scores on each server in
        rotation: any of them may have acknowledged the push and kept its old weights)."""
        probe = self.probe_ids or default_probe(_vocab_size(model))
        if hasattr(self.engine, "score_each"):
            scored = await self.engine.score_each(probe[:1], probe[1:], 1.0)
        else:
            scored = {"the engine": await self.engine.score(probe[:1], probe[1:], 1.0)}
        learner_lps = await asyncio.to_thread(sequence_logprobs, model, probe, 1)
        means: dict[str, float] = {}
        for where, lps in scored.items():
            if len(lps) != len(learner_lps):
                raise ProbeMismatchError(
                    f"{where} scored {len(lps)} probe tokens, learner {len(learner_lps)}"
                )
            means[where] = sum(abs(a - b) for a, b in zip(lps, learner_lps, strict=True)) / len(lps)
        where = max(means, key=means.__getitem__)
        mean = self.last_probe_error = means[where]
        if mean > self.cfg.probe_tolerance:
            engine_lps = scored[where]
            i = max(range(len(learner_lps)), key=lambda j: abs(engine_lps[j] - learner_lps[j]))
            others = [
                f"{w} ({m:.4f})"
                for w, m in means.items()
                if w != where and m > self.cfg.probe_tolerance
            ]
            raise ProbeMismatchError(
                f"after syncing weight version {version or self.version}: probe logprobs of "
                f"{where} differ by {mean:.4f} on average (tolerance {self.cfg.probe_tolerance}); "
                f"worst at token {i + 1} (id {probe[i + 1]}): engine {engine_lps[i]:.4f} vs "
                f"learner {learner_lps[i]:.4f}"
                + (f"; also over the tolerance: {', '.join(others)}" if others else "")
                + ". The engine did not load the pushed weights (or runs another model / dtype)."
            )
        return mean

    async def close(self) -> None:
        """Leave the distributed group (servers first, then this process)."""
        if self._pg is not None:
            try:
                await self.engine.destroy_weights_update_group(self.cfg.group_name)
            finally:
                if hasattr(self.engine, "trainer_join"):  # the engine's own communicator
                    getattr(self._pg, "destroy", lambda: None)()
                else:
                    dist.destroy_process_group(self._pg)
                self._pg = None


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise ValueError(
            "cannot pick a default probe: the model has no config.vocab_size; pass probe_ids"
        )
    return int(vocab)
