"""Start an SGLang server for RL: `agentgrpo serve-sglang MODEL [sglang args]` runs
`python -m sglang.launch_server` in the foreground until Ctrl-C; `SGLangServer` does the same as a
context manager for the training loop (the shared machinery and defaults: `engine/launch.py`):

    with SGLangServer("Qwen/Qwen2.5-0.5B-Instruct", extra_args=["--tp-size", "2"]) as server:
        engine = SGLangEngine([server.url])

What it adds for SGLang: `SGLANG_RETURN_ORIGINAL_LOGPROB` is removed from the server's
environment (with it SGLang returns temperature-1 logprobs, while rollouts record the logprobs of
the distribution they sampled from); the API key comes from `SGLANG_API_KEY`. The readiness wait
polls `/health_generate` (200 once the model is loaded and warmed up), as SGLang's own adapter,
verl and slime do.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from agentgrpo.engine import launch
from agentgrpo.engine.launch import ServerProcess, masked, serve_main

__all__ = ["DEFAULT_PORT", "SGLangServer", "build_command", "main", "masked"]

DEFAULT_PORT = 30000
MODULE = "sglang.launch_server"


def build_command(
    model: str,
    extra_args: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    module: str = MODULE,
) -> list[str]:
    """The SGLang command line: RL defaults first, then the user's arguments (which win)."""
    return launch.build_command(
        model,
        extra_args,
        host=host,
        port=port,
        api_key=api_key,
        module=module,
        model_flag="--model-path",
    )


class SGLangServer(ServerProcess):
    """One SGLang server process (see `ServerProcess`).

    Example:
        ```python
        with SGLangServer("Qwen/Qwen2.5-0.5B-Instruct", port=30000, ready_timeout_s=900) as srv:
            engine = SGLangEngine([srv.url])
            ...
        ```
    """

    name = "SGLang"
    default_module = MODULE
    default_port = DEFAULT_PORT
    model_flag = "--model-path"
    health_path = "/health_generate"
    default_api_key_env = "SGLANG_API_KEY"

    def server_env(self, env: dict[str, str]) -> dict[str, str]:
        if env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None) not in (None, "", "0", "false"):
            print(
                "warning: SGLANG_RETURN_ORIGINAL_LOGPROB removed from the server's environment "
                "(rollout logprobs must be those of the sampling distribution)",
                file=sys.stderr,
            )
        return env


def main(argv: Sequence[str] | None = None) -> int:
    """`agentgrpo serve-sglang MODEL [--ready-timeout S] [--log-file F] [sglang args ...]`."""
    ap = argparse.ArgumentParser(
        prog="agentgrpo serve-sglang",
        description="Start an SGLang server with the settings RL needs, wait until it is ready, "
        "and keep it running until Ctrl-C. Arguments after MODEL that are not listed here go to "
        "sglang.launch_server unchanged (e.g. --tp-size 2 --port 30001).",
    )
    ap.add_argument("model", help="model path or hub id (SGLang's --model-path)")
    return serve_main(SGLangServer, ap, argv)


if __name__ == "__main__":
    sys.exit(main())
