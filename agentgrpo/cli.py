"""`agentgrpo` command line: train, eval, check-env, check-template, report, and the servers.

The CLI only parses arguments and calls one function per subcommand; settings live in the typed
config (`agentgrpo.run.config`), overridden with `key.path=value` arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys

from agentgrpo.models.hardware import set_cpu_thread_env

set_cpu_thread_env()  # before anything loads torch: OpenMP reads it once (models/hardware.py)

# agentgrpo.run.config, train and evaluate load torch, and check-template loads transformers: each
# command imports them when it runs, so the forwarded servers (serve-sandbox, ...) start without.
from agentgrpo.chat.format import TemplateError  # noqa: E402
from agentgrpo.chat.shipped import load_template  # noqa: E402
from agentgrpo.checks.env_check import env_report  # noqa: E402
from agentgrpo.checks.reward_audit import audit_env  # noqa: E402
from agentgrpo.checks.template_audit import audit_template  # noqa: E402
from agentgrpo.run.report import write_report  # noqa: E402


def _train(args: argparse.Namespace) -> int:
    from agentgrpo.run.config import load_config
    from agentgrpo.run.train import train

    cfg = load_config(args.config, args.overrides)
    run_dir = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # one line per run, not one per process
        print(f"run directory: {run_dir}")
    return 0


def _check_env(args: argparse.Namespace) -> int:
    from agentgrpo.run.config import EnvConfig, apply_override

    kwargs: dict = {}
    for kv in args.kwarg:  # the constructor's arguments, as a config's env.kwargs gives them
        apply_override(kwargs, kv)
    tasks: dict = {}
    for kv in args.tasks:  # load_tasks' arguments, as a config's env.tasks gives them
        apply_override(tasks, kv)
    spec = EnvConfig(name=args.env, kwargs=kwargs, tasks=tasks)
    try:
        cls = spec.env_class()
        env = cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's module or constructor: explain, do not trace
        print(f"{args.env}: cannot create the env: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        task = spec.load_tasks(cls, "train", 0)[0] if tasks else None
    except Exception as e:  # noqa: BLE001 - the user's task source
        print(f"{args.env}: cannot load its tasks: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    report = env_report(env, task)
    print(report.format(), file=sys.stdout if report.ok else sys.stderr)
    if not report.ok or not args.audit:
        return 0 if report.ok else 1
    try:  # the verifier audits: known reward hacks, and each hack episode scored twice
        tasks = [task] if task is not None else list(cls.load_tasks("train", seed=0))
        audit = asyncio.run(audit_env(lambda: cls(**kwargs), tasks[: args.audit_tasks]))
    except Exception as e:  # noqa: BLE001 - the user's env or tasks: explain, do not trace
        print(f"{args.env}: the verifier audit failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(audit.format(), file=sys.stdout if audit.ok else sys.stderr)
    return 0 if audit.ok else 1


def _check_template(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from agentgrpo.run.config import apply_override

    kwargs: dict = {}
    for kv in args.kwarg:
        apply_override(kwargs, kv)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    template = load_template(args.template) if args.template else None
    report = audit_template(
        tokenizer,
        template,
        parser=args.parser,
        end_of_turn=args.end_of_turn,
        fallback=args.fallback,
        template_kwargs=kwargs,
        trajectory_mode=args.trajectory_mode,
    )
    print(report.format())
    return 1 if report.mode == "refuse" else 0


def _eval(args: argparse.Namespace) -> int:
    from agentgrpo.run.config import load_config
    from agentgrpo.run.evaluate import format_metrics, run_eval

    cfg = load_config(args.config, args.overrides)
    out_dir, result = run_eval(cfg)
    print(format_metrics(result.metrics))
    print(f"results: {out_dir}")
    return 0


def _report(args: argparse.Namespace) -> int:
    try:
        out = write_report(
            args.run_dir,
            args.out,
            max_trajectories=args.max_trajectories,
            max_tokens=args.max_tokens,
        )
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"report: {out}")
    return 0


# Subcommands whose argument parsing lives with their server module (they take their own flags).
FORWARDED = {
    "serve-sandbox": ("agentgrpo.verify.sandbox_server", "run the code sandbox as an HTTP server"),
    "serve-sglang": (
        "agentgrpo.engine.sglang.launch",
        "start SGLang with RL settings: MODEL [sglang args]",
    ),
    "serve-vllm": (
        "agentgrpo.engine.vllm.launch",
        "start vLLM with RL settings: MODEL [--python PY] [vllm args]",
    ),
    "serve-policy": (
        "agentgrpo.agents.serve_policy",
        "serve the policy as OpenAI's Chat Completions API, "
        "one URL per episode: MODEL_DIR [--sglang URL ...]",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentgrpo", description="Agentic multi-turn GRPO for tool-using LLMs"
    )
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_train_args, _check_env_args, _eval_args, _check_template_args, _report_args):
        add(sub)
    for name, (_, help_text) in FORWARDED.items():
        sub.add_parser(name, help=f"{help_text} (see: agentgrpo {name} --help)", add_help=False)
    return p


def _train_args(sub: argparse._SubParsersAction) -> None:
    """`train CONFIG [key=value ...]`."""
    t = sub.add_parser("train", help="train a policy: agentgrpo train CONFIG.yaml [key=value ...]")
    t.add_argument("config", help="YAML config (see examples/)")
    t.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.steps=2 output_dir=runs/x"
    )
    t.set_defaults(fn=_train)


def _check_env_args(sub: argparse._SubParsersAction) -> None:
    """`check-env NAME|MODULE:CLASS`: constructor and task arguments, the audits."""
    c = sub.add_parser(
        "check-env", help="validate an environment: agentgrpo check-env NAME|MODULE:CLASS"
    )
    c.add_argument("env")
    c.add_argument(
        "--kwarg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a constructor argument, as in a config's env.kwargs, e.g. --kwarg max_turns=3 "
        "or --kwarg python.max_output_chars=2000 (repeatable; values parsed as YAML)",
    )
    c.add_argument(
        "--tasks",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an argument of load_tasks, as in a config's env.tasks, e.g. --tasks "
        "'file=data/{split}.jsonl' --tasks prompt_key=question (repeatable); the checks "
        "run on the first task of the train split",
    )
    c.add_argument(
        "--no-audit",
        dest="audit",
        action="store_false",
        help="skip the verifier audits (known reward hacks played through the env, and each "
        "hack episode scored twice to find flaky verifiers)",
    )
    c.add_argument(
        "--audit-tasks", type=int, default=1, metavar="N", help="tasks the audits play (default 1)"
    )
    c.set_defaults(fn=_check_env)


def _eval_args(sub: argparse._SubParsersAction) -> None:
    """`eval CONFIG [key=value ...]`."""
    e = sub.add_parser(
        "eval", help="rollouts without training: agentgrpo eval CONFIG.yaml [key=value ...]"
    )
    e.add_argument(
        "config", help="YAML config (the training config; eval.* settings pick split, n, k)"
    )
    e.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides, e.g. eval.samples_per_task=8 eval.pass_k=[1,8]",
    )
    e.set_defaults(fn=_eval)


def _check_template_args(sub: argparse._SubParsersAction) -> None:
    """`check-template MODEL_DIR`: the template, parser and rollout settings audited."""
    ct = sub.add_parser(
        "check-template",
        help="audit a chat template for token-in/token-out safety: "
        "agentgrpo check-template MODEL_DIR",
    )
    ct.add_argument("model_dir", help="model directory with a tokenizer (and its chat template)")
    ct.add_argument(
        "--template",
        help="Jinja template file, or the name of a shipped one (qwen3, llama3_1, ...), to audit "
        "instead of the tokenizer's",
    )
    ct.add_argument(
        "--parser",
        default="auto",
        help="tool-call parser name (default auto: the one for the template's format)",
    )
    ct.add_argument(
        "--end-of-turn",
        action="append",
        help="token that ends an assistant turn (default: the ones the template renders, else the "
        "tokenizer's EOS); repeat it for several (GPT-OSS: <|call|> and <|return|>)",
    )
    ct.add_argument(
        "--fallback",
        default="none",
        choices=["none", "keep_history"],
        help="the rollout.template_fallback to audit with",
    )
    ct.add_argument(
        "--trajectory-mode",
        default="single",
        choices=["single", "auto", "stepwise"],
        help="the rollout.trajectory_mode to audit with (auto: segments where the "
        "template rewrites history)",
    )
    ct.add_argument(
        "--kwarg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a chat-template variable, e.g. --kwarg preserve_thinking=true (repeatable)",
    )
    ct.set_defaults(fn=_check_template)


def _report_args(sub: argparse._SubParsersAction) -> None:
    """`report RUN_DIR`: where to write and how much to embed."""
    r = sub.add_parser(
        "report", help="write RUN_DIR/report.html (plots + trajectory viewer) and RUN_DIR/plots/"
    )
    r.add_argument("run_dir", help="a run directory (output_dir of a train run)")
    r.add_argument("--out", default=None, help="HTML file to write (default: RUN_DIR/report.html)")
    r.add_argument(
        "--max-trajectories", type=int, default=200, help="trajectories embedded at most"
    )
    r.add_argument(
        "--max-tokens", type=int, default=2048, help="tokens shown per trajectory at most"
    )
    r.set_defaults(fn=_report)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in FORWARDED:
        return int(importlib.import_module(FORWARDED[argv[0]][0]).main(argv[1:]) or 0)
    from agentgrpo.run.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (
        ConfigError,
        TemplateError,
    ) as e:  # a setup the user must change: the message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
