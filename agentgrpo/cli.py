"""`agentgrpo` command line: train, check-env, report, and the servers.

The CLI only parses arguments and calls one function per subcommand; settings live in the typed
config (`agentgrpo.config`), overridden with `key.path=value` arguments.
"""

from __future__ import annotations

import argparse
import sys


def _train(args: argparse.Namespace) -> int:
    from agentgrpo.config import load_config
    from agentgrpo.train import train

    cfg = load_config(args.config, args.overrides)
    run_dir = train(cfg)
    print(f"run directory: {run_dir}")
    return 0


def _check_env(args: argparse.Namespace) -> int:
    from agentgrpo.env import EnvCheckError, check_env, get_env_class

    cls = get_env_class(args.env)
    try:
        check_env(cls())
    except EnvCheckError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.env}: OK (Gymnasium check_env and the agentgrpo message/tool contract)")
    return 0


def _report(args: argparse.Namespace) -> int:
    from agentgrpo.report import write_report

    try:
        out = write_report(args.run_dir, args.out, max_trajectories=args.max_trajectories,
                           max_tokens=args.max_tokens)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"report: {out}")
    return 0


# Subcommands whose argument parsing lives with their server module (they take their own flags).
FORWARDED = {
    "serve-sandbox": ("agentgrpo.verify.sandbox_server", "run the code sandbox as an HTTP server"),
    "serve-sglang": ("agentgrpo.engine.sglang_launch", "start SGLang with RL settings: MODEL [sglang args]"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentgrpo", description="Agentic multi-turn GRPO for tool-using LLMs")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a policy: agentgrpo train CONFIG.yaml [key=value ...]")
    t.add_argument("config", help="YAML config (see examples/)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=2 output_dir=runs/x")
    t.set_defaults(fn=_train)

    c = sub.add_parser("check-env", help="validate an environment: agentgrpo check-env NAME|MODULE:CLASS")
    c.add_argument("env")
    c.set_defaults(fn=_check_env)

    r = sub.add_parser("report", help="write RUN_DIR/report.html (plots + trajectory viewer) and RUN_DIR/plots/")
    r.add_argument("run_dir", help="a run directory (output_dir of a train run)")
    r.add_argument("--out", default=None, help="HTML file to write (default: RUN_DIR/report.html)")
    r.add_argument("--max-trajectories", type=int, default=200, help="trajectories embedded at most")
    r.add_argument("--max-tokens", type=int, default=2048, help="tokens shown per trajectory at most")
    r.set_defaults(fn=_report)
    for name, (_, help_text) in FORWARDED.items():
        sub.add_parser(name, help=help_text + " (see: agentgrpo %s --help)" % name, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    import importlib

    from agentgrpo.config import ConfigError

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in FORWARDED:
        return int(importlib.import_module(FORWARDED[argv[0]][0]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
