"""The NCCL side of `VLLMEngine`: vLLM's weight-transfer API and the trainer's end of its group.

`agentgrpo.engine.weight_sync` (method `distributed`) drives it as it drives SGLang's: once
`init_weights_update_group` (`/init_weight_transfer_engine` on every server, each with its
`rank_offset`, while the trainer joins as rank 0), then per push, inside
`paused(every_server=True)`, one `/update_weights` per bucket (one broadcast per tensor), opened by
`/start_weight_update` and closed with the version by `/finish_weight_update`. The bodies follow
vLLM 0.32's RL API router and NCCL weight-transfer engine (docs/serving.md). The trainer's end is
vLLM's own communicator (`trainer_join`), so vLLM must be installed beside the trainer (the `vllm`
extra). Not run on GPUs: the request sequence is tested against a fake server
(tests/test_vllm_engine.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentgrpo.engine.base import EngineError


class VLLMNcclUpdates:
    """Weight updates by broadcast from the trainer (see the module docstring); a mixin of
    `VLLMEngine`, whose pool, control calls and weight version it uses."""

    _nccl_open = False  # an update was started on the servers and not yet finished

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, group_name: str, backend: str = "nccl"
    ) -> None:
        """Ask every server to join the weight-transfer group (trainer = rank 0). The calls block
        until the trainer joins too: run this as a task beside `trainer_join`."""
        if backend != "nccl":
            raise EngineError(f"vLLM's weight transfer is NCCL only, not {backend!r}")
        gpus = await self.gpus_per_server()
        world_size = 1 + sum(gpus)
        offsets = [1 + sum(gpus[:i]) for i in range(len(gpus))]
        calls = []
        for s, off in zip(self._pool.servers, offsets, strict=True):
            init = {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": off,
                "world_size": world_size,
                "packed": False,
            }
            timeout = self.config.weight_update_timeout_s
            calls.append(
                self._control(
                    s, "POST", "/init_weight_transfer_engine", {"init_info": init}, timeout=timeout
                )
            )
        await asyncio.gather(*calls)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str,
        version: str | None,
    ) -> None:
        """Tell every server to receive these tensors by broadcast from rank 0, in this order;
        the first call of a push starts the update, the one with `version` finishes it. Call it
        inside `paused(every_server=True)`, as a task while broadcasting."""
        self._require_every_server(self._in_rotation())
        timeout = self.config.weight_update_timeout_s
        if not self._nccl_open:
            await self._all("POST", "/start_weight_update", timeout=timeout)
            self._nccl_open = True
        info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        await self._all("POST", "/update_weights", {"update_info": info}, timeout=timeout)
        if version is not None:
            body = {"weight_version": str(version)}
            await self._all("POST", "/finish_weight_update", body, timeout=timeout)
            self._nccl_open = False
            self._weight_version, self._last_disk_update = str(version), None

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._all("POST", "/shutdown_weight_transfer_engine")

    @staticmethod
    def trainer_join(
        master_address: str,
        master_port: int,
        *,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> Any:
        """The trainer's end of the group (rank 0): vLLM's NCCL communicator on this process's
        current CUDA device (blocks until every server has joined)."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        info = {"master_address": master_address, "master_port": master_port}
        return trainer_init({**info, "world_size": world_size}, rank=rank)

    @staticmethod
    def trainer_broadcast(group: Any, tensors: list[Any]) -> None:
        """Broadcast `tensors` from rank 0 over vLLM's communicator, one by one (unpacked)."""
        import torch

        stream = torch.cuda.current_stream()
        for t in tensors:
            group.broadcast(t.contiguous(), src=0, stream=stream)
        stream.synchronize()
