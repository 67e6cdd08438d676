"""The NCCL side of `SGLangEngine`: the weight-update process group and its broadcasts.

`agentgrpo.engine.weight_sync` (method `distributed`) drives it: `init_weights_update_group` once,
then per push, inside `paused(every_server=True)`, `update_weights_from_distributed` for each
bucket while the trainer broadcasts it. The group's ranks are all the servers (rank 0 is the
trainer), so every call here needs every server of the pool: `_require_every_server` refuses at
once, naming the ones out of rotation, instead of leaving a broadcast blocked until its timeout.

A mixin of `SGLangEngine`, whose pool, control calls, config and weight version it uses; kept apart
because it is a stage of its own (process-group setup and collectives), not request handling.
"""

from __future__ import annotations

import asyncio
from typing import Any


class NcclUpdates:
    """Weight updates by broadcast from the trainer (see the module docstring)."""

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, group_name: str, backend: str = "nccl"
    ) -> None:
        """Ask every server to join the weight-update process group (trainer = rank 0).

        The calls block until the trainer joins too: run this as a task, join the group on the
        trainer side, then await it.
        """
        gpus = await self.gpus_per_server()
        world_size = 1 + sum(gpus)
        offsets = [1 + sum(gpus[:i]) for i in range(len(gpus))]
        await asyncio.gather(
            *(
                self._control(
                    s,
                    "POST",
                    "/init_weights_update_group",
                    {
                        "master_address": master_address,
                        "master_port": int(master_port),
                        "rank_offset": off,
                        "world_size": world_size,
                        "group_name": group_name,
                        "backend": backend,
                    },
                    timeout=self.config.weight_update_timeout_s,
                )
                for s, off in zip(self._pool.servers, offsets, strict=True)
            )
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str,
        version: str | None,
    ) -> None:
        """Tell every server to receive these tensors by broadcast from rank 0, in this order.

        Blocks until the trainer has broadcast them: run as a task while broadcasting. Call it
        inside `paused(every_server=True)`. `version` (set on the last bucket only) becomes the
        weight version.

        Every server of the group, or an `EngineError` at once: the group's ranks are all the
        servers (`init_weights_update_group`), and a broadcast completes only when each rank
        joins it. Sending the update to the servers in rotation only would leave the trainer's
        broadcast blocked until its timeout; sending it to a server out of rotation cannot work
        either when it restarted (it left the group) and has no answer when it is down.
        """
        self._require_every_server(self._in_rotation())
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": version is not None and self._update_flushes(),
        }
        if version is not None:
            body["weight_version"] = str(version)
        await self._all(
            "POST",
            "/update_weights_from_distributed",
            body,
            timeout=self.config.weight_update_timeout_s,
        )
        if version is not None:
            self._weight_version, self._last_disk_update = str(version), None

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._all("POST", "/destroy_weights_update_group", {"group_name": group_name})
