"""`agentgrpo serve-policy`: the policy endpoint served alone, for agents in another process.

    export AGENTGRPO_POLICY_TOKEN=$(openssl rand -hex 32)  # or one is made and printed
    agentgrpo serve-policy MODEL_DIR                       # the local engine over the model
    agentgrpo serve-policy MODEL_DIR --sglang http://gpu1:30000 --sglang http://gpu2:30000

MODEL_DIR gives the tokenizer and chat template (with --sglang, the servers must serve the same
model). The episode API: `POST /episodes` starts one (`{"id"?, "seed"?}`; answers its `base_url`
for OpenAI's clients, `anthropic_base_url` for Anthropic's, and the episode's own `api_key`,
which an agent can use for that episode's calls and nothing else), `GET
/episodes/<id>/trajectory` returns its calls as one token-exact trajectory
(`Trajectory.to_dict()`), `POST /episodes/<id>/reward` gives it a reward, `DELETE
/episodes/<id>` forgets it. Every request needs the token, on 127.0.0.1 too (any local user can
reach a loopback port). See docs/agents.md, docs/security.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path

from agentgrpo.agents.endpoint import EndpointEpisode, PolicyEndpoint
from agentgrpo.agents.server import ServerLimits
from agentgrpo.chat.format import ChatFormat
from agentgrpo.engine.base import SamplingParams, wait_ready
from agentgrpo.engine.sglang.client import SGLangEngine

TOKEN_ENV = "AGENTGRPO_POLICY_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentgrpo serve-policy",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model_dir", help="model directory (tokenizer, chat template; the local engine's weights)"
    )
    p.add_argument(
        "--sglang",
        action="append",
        default=[],
        metavar="URL",
        help="an SGLang server to generate with instead of the local engine (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--token-file",
        help=f"file holding the bearer token (default: ${TOKEN_ENV}; neither: one is made and "
        "printed)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host header to answer besides this machine's loopback names, on a loopback bind "
        "(a reverse proxy's name; repeatable)",
    )
    p.add_argument("--model-name", default="policy", help="the model name /v1/models reports")
    p.add_argument("--parser", default="hermes", help="tool-call parser (model.tool_parser)")
    p.add_argument("--template", help="Jinja chat template file instead of the tokenizer's")
    p.add_argument(
        "--max-new-tokens", type=int, default=1024, help="tokens sampled per call at most"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="default sampling temperature")
    p.add_argument("--max-calls", type=int, default=None, help="calls per episode at most")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per episode after its first prompt at most",
    )
    p.add_argument(
        "--max-episodes",
        type=int,
        default=10_000,
        help="episodes held at once; each stays until DELETE /episodes/<id>",
    )
    p.add_argument("--max-body-mb", type=float, default=4.0, help="request body size at most")
    defaults = ServerLimits()
    for name, field in ServerLimits.model_fields.items():
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(getattr(defaults, name)),
            default=getattr(defaults, name),
            help=field.description,
        )
    return p


def _read_token(token_file: str | None) -> str | None:
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise SystemExit(f"serve-policy: token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    limits = ServerLimits(**{name: getattr(args, name) for name in ServerLimits.model_fields})
    token = _read_token(args.token_file)
    made = token is None  # a loopback port is open to every local user: never serve without one
    if made:
        token = secrets.token_urlsafe(24)
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    template = Path(args.template).read_text() if args.template else None
    chat = ChatFormat(tokenizer, template=template, parser=args.parser)
    context_len = getattr(
        AutoConfig.from_pretrained(args.model_dir), "max_position_embeddings", None
    )
    if args.sglang:
        engine = SGLangEngine(args.sglang)
    else:
        from agentgrpo.engine.local.engine import LocalEngine

        engine = LocalEngine(args.model_dir, tokenizer=tokenizer)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)

    def new_episode(eid: str, seed: int | None) -> EndpointEpisode:
        return EndpointEpisode(
            id=eid,
            engine=engine,
            chat=chat,
            # the episode's session: several --sglang servers keep it on one (its prefix cache)
            params=replace(params, session_id=eid),
            context_len=context_len,
            seed=seed,
            max_calls=args.max_calls,
            max_tokens=args.max_tokens,
        )

    endpoint = PolicyEndpoint(
        model=args.model_name,
        token=token,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_episodes=args.max_episodes,
        new_episode=new_episode,
        limits=limits,
    )

    async def serve() -> None:
        await wait_ready(engine)
        async with endpoint.serving(
            args.host, args.port, allowed_hosts=tuple(args.allowed_host)
        ) as base:
            eff = endpoint.effective
            assert eff is not None  # set while serving
            print(
                f"serve-policy: {base}/episodes (model {args.model_dir}, "
                f"{'SGLang ' + ', '.join(args.sglang) if args.sglang else 'local engine'}; "
                f"connections <= {eff.max_connections}, waiting <= {eff.max_waiting})",
                flush=True,
            )
            if made:
                print(
                    f"serve-policy: {TOKEN_ENV} is not set; this server's token is {token} "
                    "(Authorization: Bearer)",
                    flush=True,
                )
            await asyncio.Event().wait()  # until interrupted

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
