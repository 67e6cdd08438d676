"""A small fake vLLM server: real HTTP on loopback (aiohttp), the request and answer shapes of vLLM
0.32's token-in/token-out route and RL API as `VLLMEngine` uses them, and a log of every call.

It is for what a real server cannot show on a CPU (the NCCL weight-transfer sequence) and for the
client's refusals (a server without processed logprobs or the token route); the real thing runs
in tests/test_vllm_server.py. Outputs are deterministic: token i of a completion is
`(sum(prompt) + i) % 100`, each with logprob -0.5, and the spans carry the server's version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeVLLM:
    logprobs_mode: str = "processed_logprobs"
    scale_out: bool = True
    max_model_len: int = 64
    tp_size: int = 1
    version: str = "default"
    calls: list[tuple[str, Any]] = field(default_factory=list)  # (path with query, JSON body)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeVLLM:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def paths(self) -> list[str]:
        """The control calls so far (generate and probes left out), in order."""
        skip = ("/health", "/inference/v1/generate", "/server_info", "/v1/models", "/weight_info")
        return [p for p, _ in self.calls if not p.startswith(skip)]

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        path = request.path_qs
        self.calls.append((path, body))
        route = request.path
        if route == "/inference/v1/generate":
            return self._generate(body)
        if route == "/server_info":
            model = {"logprobs_mode": self.logprobs_mode, "max_model_len": self.max_model_len}
            parallel = {"tensor_parallel_size": self.tp_size, "data_parallel_size": 1}
            config = {"model_config": model, "parallel_config": parallel}
            return web.json_response({"vllm_config": config, "system_env": {"vllm_version": "0"}})
        if route == "/weight_info":
            return web.json_response({"weight_version": self.version})
        if route == "/update_weight_version":
            self.version = body["new_version"]
        if route == "/finish_weight_update" and body and body.get("weight_version"):
            self.version = body["weight_version"]
        return web.json_response({"status": "ok"})

    def _generate(self, body: dict[str, Any]) -> web.Response:
        if not self.scale_out:
            msg = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out."
            return web.json_response({"error": {"message": msg, "code": 403}}, status=403)
        prompt, sp = body["token_ids"], body["sampling_params"]
        if len(prompt) > self.max_model_len:
            msg = (
                f"The decoder prompt (length {len(prompt)}) is longer than the maximum model "
                f"length of {self.max_model_len}."
            )
            return web.json_response({"error": {"message": msg, "code": 400}}, status=400)
        n = min(sp["max_tokens"], self.max_model_len - len(prompt))
        ids = [(sum(prompt) + i) % 100 for i in range(n)]
        content = [{"token_id": t, "logprob": -0.5} for t in ids]
        choice = {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": ids,
            "logprobs": {"content": content},
            "weight_versions": [{"version": self.version, "start": 0, "end": n}],
        }
        out: dict[str, Any] = {"request_id": body.get("request_id"), "choices": [choice]}
        if sp.get("prompt_logprobs") is not None:
            out["prompt_logprobs"] = [None] + [{str(t): {"logprob": -1.0}} for t in prompt[1:]]
        return web.json_response(out)
