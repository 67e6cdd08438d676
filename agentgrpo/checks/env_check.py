"""Validation of environments: scripted episodes that explain each broken promise.

`env_report(env, task)` runs an env through reset and step with scripted actions and returns one
`EnvCheck` per promise of the Env contract: what was checked, whether it held, and, when it did
not, what was found and why it matters. `check_env` (re-exported as `agentgrpo.check_env`) raises
`EnvCheckError` listing the failures; `agentgrpo check-env MODULE:CLASS` prints the whole report.
`check_env_at_start` is the part training and evaluation run once before the first rollout (the
conversions of every value, `EnvStep.of` and `reset_messages`, live in `agentgrpo.env`).

The scripted actions: reset twice with one seed (determinism, unless the env declares
`stochastic`); for a ToolEnv, a call to an unknown tool, a call with invalid arguments, and one call
of every tool with example arguments built from its JSON schema (a tool may reject them, but it
must answer with a tool message); finally a plain answer. Gymnasium's own `check_env` runs last,
through a sync view for async envs. Tools really run: check an env where running them is safe.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any

import gymnasium
from gymnasium.utils.env_checker import check_env as gym_check

from agentgrpo.env.base import Env, EnvCheckError, ToolEnv, reset_messages, run_sync
from agentgrpo.types import EnvStep, Message, Task, ToolCall

# `info` keys through which an env spoke to the framework before `EnvStep` (read no more).
_OLD_INFO_KEYS = ("stop_reason", "tool_errors", "tool_error_kinds")


# ---------------------------------------------------------------------------------------------
# Scripted checks (`env_report`, `check_env`)


@dataclass
class EnvCheck:
    name: str
    ok: bool
    detail: str = ""  # what was seen, and for a failure why it matters / how to fix it


@dataclass
class EnvReport:
    env: str
    checks: list[EnvCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[EnvCheck]:
        return [c for c in self.checks if not c.ok]

    def format(self) -> str:
        lines = [f"{self.env}: {'OK' if self.ok else 'FAILED'}"]
        for c in self.checks:
            lines.append(
                f"  [{'ok' if c.ok else 'FAIL'}] {c.name}" + (f": {c.detail}" if c.detail else "")
            )
        return "\n".join(lines)


class _SyncView(gymnasium.Env):
    """Presents an env with async reset/step to Gymnasium's (sync) checker."""

    def __init__(self, env: Env) -> None:
        self.inner = env
        self.observation_space, self.action_space = env.observation_space, env.action_space
        self.metadata = env.metadata

    @property
    def _np_random(self):  # the checker inspects the RNG of the env it was given
        return self.inner._np_random

    @_np_random.setter
    def _np_random(self, value):
        if hasattr(self, "inner"):
            self.inner._np_random = value

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        return run_sync(self.inner.reset(seed=seed, options=options))

    def step(self, action: Message):
        return run_sync(self.inner.step(action))


def example_arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """Plausible arguments for a JSON-schema object: defaults, first enum values, or a value of
    the declared type, for the required properties only."""
    out: dict[str, Any] = {}
    props = parameters.get("properties", {})
    for name in parameters.get("required", []):
        out[name] = _example_value(props.get(name, {}))
    return out


def _example_value(schema: dict[str, Any]) -> Any:
    if "default" in schema:
        return schema["default"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return _example_value(schema[key][0])
    examples = {
        "string": "1",
        "integer": 1,
        "number": 1,
        "boolean": True,
        "array": [],
        "object": {},
        "null": None,
    }
    return examples.get(schema.get("type", "string"), "1")


def _call(label: str, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, EnvCheck | None]:
    """Run env code; an exception becomes a failed check instead of a crash of the checker."""
    try:
        return run_sync(fn(*args, **kwargs)), None
    except Exception as e:  # noqa: BLE001 - env code is user code: its failure is the finding
        return None, EnvCheck(
            label,
            False,
            f"raised {type(e).__name__}: {e}. The rollout would end "
            "every episode with ENV_ERROR (unscorable).",
        )


def _is_message_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(m, Message) for m in x)


def _check_schemas(env: Env) -> list[EnvCheck]:
    out = []
    for schema in env.tool_schemas():
        fn = schema.get("function", {}) if isinstance(schema, dict) else {}
        label = f"tool schema {fn.get('name', '?')!r}"
        if schema.get("type") != "function" or not fn.get("name") or not fn.get("description"):
            out.append(
                EnvCheck(
                    label,
                    False,
                    "tool schema needs type 'function', a name and a "
                    f"description (the model reads it): {schema!r:.200}",
                )
            )
        elif fn.get("parameters", {}).get("type") != "object":
            out.append(
                EnvCheck(
                    label,
                    False,
                    f"tool {fn['name']!r}: parameters must be a JSON-schema "
                    "object (OpenAI function-calling format)",
                )
            )
        else:
            out.append(EnvCheck(label, True))
    return out


def _check_tools(env: ToolEnv, task: Task) -> list[EnvCheck]:
    """Unknown tool, invalid arguments, and every tool once: each must give one tool message
    answering the call's id, without ending the episode."""
    scripted = [
        (
            "call to an unknown tool",
            ToolCall(id="call_unknown", name="__no_such_tool__"),
            "unknown tool",
        ),
        ("call with invalid arguments", None, "Error"),
    ]
    tools = env.get_tools()
    if tools:
        first = next(iter(tools.values()))
        scripted[1] = (
            "call with invalid arguments",
            ToolCall(id="call_invalid", name=first.name, arguments={"__not_a_parameter__": 1}),
            "Error",
        )
    else:
        scripted.pop()
    for t in tools.values():
        args = example_arguments(t.schema["function"]["parameters"])
        scripted.append(
            (
                f"tool {t.name}({', '.join(f'{k}={v!r}' for k, v in args.items())})",
                ToolCall(id=f"call_{t.name}", name=t.name, arguments=args),
                None,
            )
        )
    out = []
    for label, call, needle in scripted:
        _, failed = _call(label, env.reset, seed=0, options={"task": task})
        if failed is None:
            result, failed = _call(
                label, env.step, Message(role="assistant", content="", tool_calls=[call])
            )
        if failed is not None:
            out.append(failed)
            continue
        msgs = result[0] if isinstance(result, tuple) and len(result) == 5 else None
        if (
            not (
                _is_message_list(msgs)
                and len(msgs) == 1
                and msgs[0].role == "tool"
                and msgs[0].tool_call_id == call.id
            )
            or result[2]
            or result[3]
        ):
            out.append(
                EnvCheck(
                    label,
                    False,
                    "expected one tool message answering "
                    f"tool_call_id={call.id!r} and the episode going on, got {result!r:.300}",
                )
            )
        elif needle and needle not in msgs[0].content:
            out.append(
                EnvCheck(
                    label,
                    False,
                    f"expected an error message containing {needle!r} so the "
                    f"model can correct itself, got {msgs[0].content!r:.200}",
                )
            )
        else:
            out.append(EnvCheck(label, True, f"-> {msgs[0].content!r:.80}"))
    return out


def _check_step(env: Env, task: Task) -> list[EnvCheck]:
    label = "answer step (assistant says '42')"
    _, failed = _call(label, env.reset, seed=0, options={"task": task})
    if failed is None:
        result, failed = _call(label, env.step, Message(role="assistant", content="42"))
    if failed is not None:
        return [failed]
    problems = []
    try:
        step = EnvStep.of(result)  # the conversion the rollout makes of every step
    except ValueError as e:
        step = None
        problems.append(f"{e} (the rollout ends the episode with ENV_ERROR)")
    if (
        isinstance(result, tuple)
        and len(result) == 5
        and not all(isinstance(b, bool) for b in result[2:4])
    ):
        problems.append("step's terminated and truncated must be bools (Gymnasium's API)")
    if step is not None and (old := [k for k in _OLD_INFO_KEYS if k in step.info]):
        problems.append(
            f"step's info holds {old}: the framework no longer reads them; return "
            "agentgrpo.EnvStep(messages, reward, terminated, truncated, info, "
            "stop_reason=..., tool_errors=...) instead"
        )
    if step is not None:
        try:
            json.dumps(step.info, default=str, skipkeys=True)
        except Exception as e:  # noqa: BLE001 - user objects: any of them may fail to convert
            problems.append(
                f"step's info cannot be written as JSON ({type(e).__name__}: {e}); "
                "trajectories.jsonl keeps an ending step's info"
            )
    if step is not None and step.stop_reason is None and not step.messages:
        problems.append(
            "step returned no messages but did not end the episode: the model would "
            "be asked again with nothing new (the rollout ends it with ENV_ERROR)"
        )
    if problems or step is None:
        return [EnvCheck(label, False, "; ".join(problems))]
    end = (
        step.stop_reason.value
        if step.stop_reason is not None
        else f"{len(step.messages)} new message(s)"
    )
    return [EnvCheck(label, True, f"reward {step.reward}, {end}")]


def env_report(env: Env, task: Task | None = None) -> EnvReport:
    """Run every check and return the report (never raises for env failures)."""
    report = EnvReport(type(env).__name__)
    if not isinstance(env, Env):
        report.checks.append(
            EnvCheck(
                "subclass of agentgrpo.Env",
                False,
                f"{type(env).__name__} must subclass agentgrpo.Env (a gymnasium.Env)",
            )
        )
        return report
    if task is None:
        task = _first_task(env, report)
        if task is None:
            return report
    if not _check_reset(env, task, report):
        return report
    report.checks += _check_schemas(env)
    if isinstance(env, ToolEnv):
        report.checks += _check_tools(env, task)
    report.checks += _check_step(env, task)
    if report.ok:
        report.checks.append(_gym_check(env))
    return report


def _first_task(env: Env, report: EnvReport) -> Task | None:
    """The first task of the env's train split; None (and a failed check) when it has none."""
    try:
        return next(iter(type(env).load_tasks("train", seed=0)))
    except (NotImplementedError, StopIteration) as e:
        report.checks.append(
            EnvCheck(
                "load_tasks('train')",
                False,
                f"no task given and "
                f"{e or 'load_tasks returned no tasks'} (check-env: "
                "--tasks file=... gives a task file)",
            )
        )
        return None


def _check_reset(env: Env, task: Task, report: EnvReport) -> bool:
    """Reset's value, and a second reset with the same seed: the same messages unless the env
    declares itself stochastic. False when reset fails (the other checks need its messages)."""
    first, failed = _call("reset", env.reset, seed=0, options={"task": task})
    if failed is not None:
        report.checks.append(failed)
        return False
    try:
        obs = reset_messages(first)
    except ValueError as e:
        report.checks.append(
            EnvCheck("reset", False, f"{e} (the rollout ends every episode with ENV_ERROR)")
        )
        return False
    report.checks.append(EnvCheck("reset", True, f"{len(obs)} message(s): {[m.role for m in obs]}"))
    again, failed = _call(
        "reset is a function of (task, seed)", env.reset, seed=0, options={"task": task}
    )
    if failed is not None:
        report.checks.append(failed)
    elif env.stochastic:
        report.checks.append(
            EnvCheck(
                "reset is a function of (task, seed)",
                True,
                "skipped: the env declares stochastic = True",
            )
        )
    else:
        same = isinstance(again, tuple) and again[0] == obs
        report.checks.append(
            EnvCheck(
                "reset is a function of (task, seed)",
                same,
                ""
                if same
                else "two resets with seed=0 gave different messages; every member of a GRPO "
                "group must start from the same state. Seed all randomness from reset's seed, "
                "or set stochastic = True and document what varies",
            )
        )
    return True


def _gym_check(env: Env) -> EnvCheck:
    """gymnasium's own check_env, on a synchronous view of an async env."""
    try:
        view = (
            env
            if not (inspect.iscoroutinefunction(env.step) or inspect.iscoroutinefunction(env.reset))
            else _SyncView(env)
        )
        gym_check(view, skip_render_check=True, skip_close_check=True)
        return EnvCheck("gymnasium check_env", True)
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        return EnvCheck("gymnasium check_env", False, f"{type(e).__name__}: {e}")


def check_env_at_start(env: Env, task: Task) -> None:
    """The part of the contract training and evaluation check once, before the first rollout:
    reset's value (twice with one seed, for determinism) and the tool schemas. Steps are not run
    here, since they run tools (`agentgrpo check-env` runs them); the rollout converts every step
    with `EnvStep.of`, which ends a trajectory that breaks it with ENV_ERROR. Raises EnvCheckError
    listing the failures."""
    first, failed = _call("reset", env.reset, seed=0, options={"task": task})
    checks = [failed] if failed is not None else []
    if failed is None:
        try:
            obs = reset_messages(first)
            again, failed = _call("reset", env.reset, seed=0, options={"task": task})
            same = failed is None and isinstance(again, tuple) and again[0] == obs
            checks.append(
                failed
                or EnvCheck(
                    "reset is a function of (task, seed)",
                    same or env.stochastic,
                    ""
                    if same
                    else "two resets with seed=0 gave different messages; seed all "
                    "randomness from reset's seed, or set stochastic = True",
                )
            )
        except ValueError as e:
            checks.append(EnvCheck("reset", False, str(e)))
        checks += _check_schemas(env)
    if bad := [c for c in checks if not c.ok]:
        raise EnvCheckError(
            f"{type(env).__name__} breaks the Env contract:\n- "
            + "\n- ".join(f"{c.name}: {c.detail}" for c in bad)
        )


def check_env(env: Env, task: Task | None = None) -> None:
    """Validate an environment: Gymnasium's `check_env` plus the message and tool contract.

    Raises EnvCheckError listing each failure with what was expected. `task` defaults to the first
    task of `env.load_tasks("train")`.
    """
    report = env_report(env, task)
    if not report.ok:
        raise EnvCheckError(
            f"{report.env} breaks the Env contract:\n- "
            + "\n- ".join(f"{c.name}: {c.detail}" for c in report.failures())
        )
