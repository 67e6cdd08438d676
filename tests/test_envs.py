"""The bundled environments: the Env contract, rewards and stop reasons of whole episodes (a
scripted engine on the real SmolLM2 tokenizer, the real sandbox), sandbox failures as NaN, and one
training step of each env with a tiny random model through the command line."""

from __future__ import annotations

import asyncio
import doctest
import importlib
import json
import math
import sys
from pathlib import Path

import pytest
from gymnasium.envs.registration import find_highest_version

from agentgrpo import Message, StopReason, Task, check_env
from agentgrpo.cli import main
from agentgrpo.engine import SamplingParams
from agentgrpo.env.base import get_env_class, known_env_names
from agentgrpo.rollout.episode import EpisodeLimits, run_episode
from agentgrpo.run.log import read_jsonl
from agentgrpo.verify import math as math_mod
from agentgrpo.verify.code import load_humaneval, run_tests
from agentgrpo.verify.math import MathPool, math_equal
from agentgrpo.verify.sandbox import ExecResult
from envs.code_tests import CodeTestsEnv, docstring_examples
from envs.gym_text import GymTextEnv
from envs.python_math import PythonMathEnv, final_answer
from tests.fakes import ScriptedEngine

NAMES = ["calculator", "calculator_steps", "python_math", "code_tests", "gym_text"]


class BrokenSandbox:
    """A sandbox whose infrastructure fails on every job (what the real one returns after its
    retries when its supervisor keeps dying or a remote server is unreachable)."""

    def __init__(self) -> None:
        self.jobs = 0

    def _result(self) -> ExecResult:
        self.jobs += 1
        return ExecResult(
            "sandbox_error", None, None, "", "", False, 0.0, "broken", "supervisor died 3 times"
        )

    def run(self, code, **kwargs) -> ExecResult:
        return self._result()

    async def arun(self, code, **kwargs) -> ExecResult:
        return self._result()


def episode(chat, env, task, script, *, max_turns=4, max_tokens=1024, max_new_tokens=400):
    engine = ScriptedEngine(chat.tokenizer, script, chat.end_of_turn_id)
    traj = asyncio.run(
        run_episode(
            env,
            engine,
            chat,
            task,
            SamplingParams(max_new_tokens=max_new_tokens),
            seed=0,
            limits=EpisodeLimits(max_turns=max_turns, max_tokens=max_tokens),
        )
    )
    traj.check()
    return traj, engine


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---- all envs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_registered_env_passes_check_env_and_loads_both_splits(name):
    cls = get_env_class(name)  # an entry point of pyproject.toml's agentgrpo.envs group
    assert name in known_env_names() and cls.__module__ == f"envs.{name}"
    check_env(cls())
    train, held_out = cls.load_tasks("train", seed=0), cls.load_tasks("eval", seed=0)
    assert train and held_out and {t.id for t in train}.isdisjoint({t.id for t in held_out})
    assert "Example:" in (cls.__doc__ or "")


@pytest.mark.parametrize("module", ["envs.python_math", "envs.code_tests", "envs.gym_text"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


# ---- python_math --------------------------------------------------------------------------------


def test_final_answer_extraction():
    assert final_answer("so \\boxed{\\frac{1}{2}} it is") == "\\frac{1}{2}"
    assert math_equal(final_answer("so \\boxed{\\frac{1}{2}}"), "0.5")
    assert final_answer("first \\boxed{3} then \\boxed{7}") == "7"
    assert (
        final_answer("about 1.5e3 of them") == final_answer("\\boxed{1.5e3}") == "1500"
    )  # not 1*e*3
    assert math_equal(final_answer("about 1.5e3 of them"), "1500")
    assert final_answer("We had 12 eggs, so 1,234.5 in all.") == "1234.5"
    assert final_answer("-3 and then 3/4") == "3/4"
    assert final_answer("\\boxed{12") == "12"  # an unclosed box falls back to the last number
    assert final_answer("no idea") is None


def test_python_math_tasks_are_deterministic_and_splits_disjoint():
    kw = {"dataset": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    train = PythonMathEnv.load_tasks("train", seed=3, n=300, **kw)
    held_out = PythonMathEnv.load_tasks("eval", seed=3, n=30, **kw)
    assert len(train) == 300 and len(held_out) == 30
    assert train == PythonMathEnv.load_tasks("train", seed=3, n=300, **kw)
    # one-digit sums repeat, yet no question is in both splits
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in held_out})
    gsm = PythonMathEnv.load_tasks("train", seed=0, n=3)
    assert gsm[0].metadata["dataset"] == "gsm_symbolic" and gsm[0].answer.lstrip("-").isdigit()
    with pytest.raises(TypeError, match="chain_sum"):
        PythonMathEnv.load_tasks("train", n=2, dataset="chain_sum", max_termz=3)
    with pytest.raises(ValueError, match="split"):
        PythonMathEnv.load_tasks("test")


@pytest.fixture(scope="module")
def math_task() -> Task:
    return PythonMathEnv.load_tasks("train", seed=0, n=1)[0]  # carpenter problem -> 28080


def test_python_math_solved_with_the_tool(chat, math_task):
    code = "print(2 * 6 * 12 * 195)"
    traj, engine = episode(
        chat, PythonMathEnv(), math_task, [call("python", code=code), "He earns \\boxed{28080}."]
    )
    assert math_task.answer == "28080"
    assert (traj.stop_reason, traj.reward, traj.tool_calls, traj.tool_errors) == (
        StopReason.COMPLETED,
        1.0,
        1,
        0,
    )
    tool_msg = traj.messages[3]
    assert (
        tool_msg.role == "tool" and "status: ok" in tool_msg.content and "28080" in tool_msg.content
    )
    assert tool_msg.content in chat.decode(engine.calls[1][-60:])  # the model saw the output


def test_python_math_wrong_missing_and_malformed_answers_score_zero(chat, math_task):
    wrong, _ = episode(chat, PythonMathEnv(), math_task, ["\\boxed{28081}"])
    assert (wrong.stop_reason, wrong.reward) == (StopReason.COMPLETED, 0.0)
    missing, _ = episode(chat, PythonMathEnv(), math_task, ["I cannot tell."])
    assert (missing.stop_reason, missing.reward) == (StopReason.COMPLETED, 0.0)
    bad_call = '<tool_call>{"name": "python", "arguments": {"code": </tool_call>'
    malformed, _ = episode(chat, PythonMathEnv(), math_task, [bad_call, "28080"])
    assert (malformed.stop_reason, malformed.reward, malformed.tool_errors) == (
        StopReason.COMPLETED,
        1.0,
        1,
    )


def test_python_math_model_code_errors_are_tool_output_not_env_errors(chat, math_task):
    traj, _ = episode(
        chat, PythonMathEnv(), math_task, [call("python", code="print(1/0)"), "28080"]
    )
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0
    assert (
        "runtime_error" in traj.messages[3].content
        and "ZeroDivisionError" in traj.messages[3].content
    )


def test_python_math_sandbox_failure_is_unscorable(chat, math_task):
    sandbox = BrokenSandbox()
    traj, engine = episode(
        chat,
        PythonMathEnv(sandbox=sandbox),
        math_task,
        [call("python", code="print(1)"), "\\boxed{28080}"],
    )
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward)
    assert "SandboxUnavailable" in traj.stop_detail and sandbox.jobs == 1
    assert len(engine.calls) == 1  # the failure was never shown to the model as its tool error


@pytest.fixture
def math_pool(monkeypatch):
    """A private math-verify pool behind `math_check` for one test (its counters are the test's)."""
    pool = MathPool(workers=1, wall_factor=10)  # generous: a loaded test host is not "starved"
    monkeypatch.setattr(math_mod, "default_pool", lambda: pool)
    yield pool
    pool.close()


def test_python_math_verifier_failure_is_unscorable(chat, math_task, math_pool, monkeypatch):
    monkeypatch.setattr(
        sys, "executable", "/nonexistent/python3"
    )  # math-verify workers cannot start
    traj, _ = episode(chat, PythonMathEnv(), math_task, ["\\boxed{28080.0}"])  # needs a real check
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward)  # not 0
    assert "MathVerifyUnavailable" in traj.stop_detail and "could not start" in traj.stop_detail
    assert (math_pool.failures, math_pool.unscorable) == (2, 1)


RUNAWAY = "So the answer is \\boxed{10**10**10**10}"  # sympy cannot finish this power


@pytest.mark.parametrize(
    "reply", ["so \\boxed{10^{3}}", "so \\boxed{2**10}", "so \\boxed{1.5e3}", "it is 1000"]
)
def test_python_math_reads_latex_and_expressions_in_the_box(chat, math_task, math_pool, reply):
    """`10^{3}` is LaTeX (math-verify reads it only inside the box), `2**10` an expression (only
    outside it): each reading is tried, so both score."""
    want = {
        "so \\boxed{10^{3}}": 1000,
        "so \\boxed{2**10}": 1024,
        "so \\boxed{1.5e3}": 1500,
        "it is 1000": 1000,
    }
    env = PythonMathEnv()
    env.reset(seed=0, options={"task": math_task.model_copy(update={"answer": want[reply]})})
    _, reward, *_ = asyncio.run(env.step(Message(role="assistant", content=reply)))
    assert reward == 1.0
    env.reset(seed=0, options={"task": math_task.model_copy(update={"answer": 7})})
    _, reward, *_ = asyncio.run(env.step(Message(role="assistant", content=reply)))
    assert reward == 0.0


def test_python_math_runaway_answer_scores_zero_as_parse_error(chat, math_task, math_pool):
    # The model's doing: 0, but counted as unusable output, not passed off as a plain wrong answer
    traj, _ = episode(chat, PythonMathEnv(math_timeout_s=0.5), math_task, [RUNAWAY])
    assert (traj.stop_reason, traj.reward, math_pool.timeouts) == (StopReason.PARSE_ERROR, 0.0, 1)
    assert "CPU budget" in traj.env_info["math_verify"]  # why, in trajectories.jsonl
    env = PythonMathEnv(math_timeout_s=0.5)
    env.reset(seed=0, options={"task": math_task})
    step = asyncio.run(env.step(Message(role="assistant", content=RUNAWAY)))
    _, reward, terminated, _, info = step
    assert (reward, terminated, step.stop_reason) == (0.0, True, StopReason.PARSE_ERROR)
    assert "CPU budget" in info["math_verify"] and math_pool.timeouts == 2
    with pytest.raises(ValueError, match="math_timeout_s"):
        PythonMathEnv(math_timeout_s=0)


# ---- code_tests ---------------------------------------------------------------------------------

PROBLEMS = {p.task_id: p for p in load_humaneval()}


def test_public_examples_hold_for_the_canonical_solutions():
    """Every docstring example the env runs is satisfied by the reference solution (one sandbox job
    per problem), and the parser still finds examples for most problems."""
    with_examples, failures = 0, []
    for p in PROBLEMS.values():
        examples = docstring_examples(p)
        if not examples:
            continue
        with_examples += 1
        res = run_tests(p.prompt + p.canonical_solution, [e.as_test() for e in examples])
        failures += [
            (p.task_id, examples[t.index].call, t.detail)
            for t in res.tests
            if t.outcome != "passed"
        ]
    assert failures == []
    assert with_examples >= 135


def test_code_tests_splits_are_fixed_and_cover_humaneval():
    train, held_out = CodeTestsEnv.load_tasks("train"), CodeTestsEnv.load_tasks("eval", seed=7)
    assert (len(train), len(held_out)) == (131, 33)
    assert {t.id for t in train} | {t.id for t in held_out} == set(PROBLEMS)
    assert all(int(t.id.split("/")[1]) % 5 == 0 for t in held_out)
    assert held_out == CodeTestsEnv.load_tasks("eval", seed=0)
    assert (
        len(CodeTestsEnv.load_tasks("all")) == 164
        and len(CodeTestsEnv.load_tasks("train", n=3)) == 3
    )
    with pytest.raises(ValueError, match="split"):
        CodeTestsEnv.load_tasks("test")


@pytest.fixture(scope="module")
def code_task() -> Task:
    return CodeTestsEnv.load_tasks("eval")[0]  # HumanEval/0 has_close_elements, 2 examples


def _fence(code: str) -> str:
    return f"Here it is:\n```python\n{code}```"


CANONICAL = PROBLEMS["HumanEval/0"].prompt + PROBLEMS["HumanEval/0"].canonical_solution
ALWAYS_TRUE = (
    "def has_close_elements(numbers, threshold):\n    return True\n"  # passes example 2 only
)


def test_code_tests_test_revise_submit(chat, code_task):
    script = [
        call("run_tests", code=ALWAYS_TRUE),
        call("run_tests", code=CANONICAL),
        _fence(CANONICAL),
    ]
    traj, _ = episode(chat, CodeTestsEnv(), code_task, script)
    assert (traj.stop_reason, traj.reward, traj.tool_calls) == (StopReason.COMPLETED, 1.0, 2)
    first, second = traj.messages[3].content, traj.messages[5].content
    assert first.startswith("1/2 examples passed") and "returned True, expected False" in first
    assert second.startswith("2/2 examples passed")


def test_code_tests_scores_the_tested_code_when_the_reply_has_none(chat, code_task):
    traj, _ = episode(chat, CodeTestsEnv(), code_task, [call("run_tests", code=CANONICAL), "Done."])
    assert (traj.stop_reason, traj.reward) == (StopReason.COMPLETED, 1.0)


def test_code_tests_wrong_and_malformed_submissions(chat, code_task):
    wrong, _ = episode(chat, CodeTestsEnv(), code_task, [_fence(ALWAYS_TRUE)])
    assert (wrong.stop_reason, wrong.reward) == (StopReason.COMPLETED, 0.0)
    partial, _ = episode(chat, CodeTestsEnv(public_credit=0.5), code_task, [_fence(ALWAYS_TRUE)])
    assert partial.reward == 0.25  # 0.5 * (1 of 2 examples)
    prose, _ = episode(
        chat, CodeTestsEnv(public_credit=0.5), code_task, ["I would sort the list first."]
    )
    assert (prose.stop_reason, prose.reward) == (StopReason.COMPLETED, 0.0)
    broken_call = '<tool_call>{"name": "run_tests", "arguments": {"code": 1}}</tool_call>'
    invalid, _ = episode(chat, CodeTestsEnv(), code_task, [broken_call, _fence(CANONICAL)])
    assert (invalid.reward, invalid.tool_errors) == (1.0, 1)
    assert "invalid arguments" in invalid.messages[3].content


def test_code_tests_problem_without_examples_still_runs_the_code(chat):
    task = next(
        t for t in CodeTestsEnv.load_tasks("all") if t.id == "HumanEval/38"
    )  # decode_cyclic
    assert task.metadata["examples"] == []
    env = CodeTestsEnv()
    env.reset(seed=0, options={"task": task})
    ok = env.run_tests(code="def decode_cyclic(s):\n    return s\n")
    assert ok.startswith("The docstring has no examples") and "example 1: passed" in ok
    broken = env.run_tests(code="def decode_cyclic(s):\n    return s[\n")
    assert "example 1: error: SyntaxError" in broken


@pytest.mark.parametrize("where", ["run_tests", "scoring"])
def test_code_tests_sandbox_failure_is_unscorable(chat, code_task, where):
    sandbox = BrokenSandbox()
    script = (
        [call("run_tests", code=CANONICAL), _fence(CANONICAL)]
        if where == "run_tests"
        else [_fence(CANONICAL)]
    )
    traj, engine = episode(chat, CodeTestsEnv(sandbox=sandbox), code_task, script)
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward)
    assert "SandboxUnavailable" in traj.stop_detail and sandbox.jobs == 1 and len(engine.calls) == 1


# ---- gym_text -----------------------------------------------------------------------------------

LAKE = ["SFFF", "FHFH", "FFFH", "HFFG"]  # Gymnasium's 4x4 map


def lake_task(**make_kwargs) -> Task:
    return Task(
        id="lake",
        prompt="Play FrozenLake-v1.",
        metadata={
            "env_id": "FrozenLake-v1",
            "reset_seed": 0,
            "make_kwargs": {"desc": LAKE, "is_slippery": False, **make_kwargs},
        },
    )


def test_gym_text_reaches_the_goal(chat):
    moves = ["DOWN", "I go down", "right", "RIGHT.", "DOWN", "Not LEFT but RIGHT"]
    traj, engine = episode(chat, GymTextEnv(), lake_task(), moves, max_turns=10)
    assert (traj.stop_reason, traj.reward, traj.num_turns) == (StopReason.COMPLETED, 1.0, 6)
    first = traj.messages[1].content
    assert first.startswith("X F F F\nF H F H") and "row 1, column 1" in first
    assert "row 3, column 1" in traj.messages[5].content  # after DOWN, DOWN
    assert "episode is over (reward 1)" in traj.messages[-1].content
    assert len(engine.calls) == 6


def test_gym_text_hole_ends_the_episode_without_reward(chat):
    traj, _ = episode(chat, GymTextEnv(), lake_task(), ["RIGHT", "DOWN"], max_turns=10)
    assert (traj.stop_reason, traj.reward, traj.num_turns) == (StopReason.COMPLETED, 0.0, 2)


def test_gym_text_invalid_replies_reprompt_then_end(chat):
    traj, _ = episode(chat, GymTextEnv(), lake_task(), ["hmm", "DOWN", "what?", "no"], max_turns=10)
    assert traj.stop_reason == StopReason.PARSE_ERROR and traj.num_turns == 4
    assert traj.reward == pytest.approx(
        -0.3
    )  # three invalid replies at 0.1 each; ended by the third
    assert (
        traj.messages[3].content
        == "That reply names no action. Reply with one action: LEFT, DOWN, RIGHT, UP."
    )
    ended, _ = episode(
        chat, GymTextEnv(on_invalid="end", invalid_penalty=0.5), lake_task(), ["hmm"]
    )
    assert (ended.stop_reason, ended.reward, ended.num_turns) == (StopReason.PARSE_ERROR, -0.5, 1)


def test_gym_text_time_limit_truncates(chat):
    traj, _ = episode(chat, GymTextEnv(), lake_task(max_episode_steps=3), ["LEFT"], max_turns=10)
    assert (traj.stop_reason, traj.reward, traj.num_turns) == (StopReason.TRUNCATED, 0.0, 3)


def test_gym_text_tasks_fix_the_start_state():
    tasks = GymTextEnv.load_tasks("train", seed=0, n=20, map_size=4)
    maps = {tuple(t.metadata["make_kwargs"]["desc"]) for t in tasks}
    assert len(maps) > 10 and tasks == GymTextEnv.load_tasks("train", seed=0, n=20, map_size=4)
    env = GymTextEnv()
    a, _ = env.reset(seed=1, options={"task": tasks[0]})
    b, _ = env.reset(seed=2, options={"task": tasks[0]})
    assert a == b  # the task, not the rollout's seed, fixes the start
    with pytest.raises(ValueError, match="FrozenLake"):
        GymTextEnv.load_tasks("train", env_id="Taxi-v4", map_size=4)


def test_gym_text_other_toy_text_and_generic_envs():
    env = GymTextEnv(on_invalid="end")
    task = GymTextEnv.load_tasks("train", seed=0, n=1, env_id="Blackjack-v1")[0]
    msgs, _ = env.reset(seed=0, options={"task": task})
    assert msgs[1].content.startswith("Your cards total")
    _, reward, terminated, _, info = env.step(Message(role="assistant", content="I STICK"))
    assert terminated and reward in (-1.0, 0.0, 1.0) and info["action"] == "STICK"
    # CliffWalking is v0 in gymnasium 1.0 (the floor), v1 from 1.1: the newest registered one.
    cliff_id = f"CliffWalking-v{find_highest_version(None, 'CliffWalking')}"
    cliff = GymTextEnv.load_tasks("train", seed=0, n=1, env_id=cliff_id)[0]
    msgs, _ = env.reset(seed=0, options={"task": cliff})
    assert "\x1b" not in msgs[1].content and "x  C  C" in msgs[1].content
    assert msgs[0].content.endswith("Reply with one action: 0, 1, 2, 3.")
    continuous = Task(
        id="c", prompt="-", metadata={"env_id": "MountainCarContinuous-v0", "reset_seed": 0}
    )
    with pytest.raises(TypeError, match="needs Discrete"):
        env.reset(seed=0, options={"task": continuous})


# ---- one training step each ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def terse_model_dir(tmp_path_factory, smol_tokenizer, chat) -> Path:
    """A tiny random Llama (SmolLM2's vocabulary) that ends its turn with probability about 0.3 at
    every token, so its replies are a few random tokens and episodes reach the env's `step` and
    `reward`. (A plain random model almost never samples the end-of-turn token: every episode would
    run out of tokens before the env scores it.) How: a large bias on the last MLP output makes
    the final hidden state nearly constant, and the end-of-turn embedding (tied to the output
    layer) points along it with a logit of about 10, against about 0 for the 49k other tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(smol_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        mlp_bias=True,
        eos_token_id=smol_tokenizer.eos_token_id,
        pad_token_id=smol_tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    direction = torch.nn.functional.normalize(torch.randn(32), dim=0)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.bias.copy_(50 * direction)
        model.model.embed_tokens.weight[chat.end_of_turn_id] = 10 / 32**0.5 * direction
    d = tmp_path_factory.mktemp("terse-llama")
    model.save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    return d


SHORT = {
    "python_math": ["env.tasks.n=8", "rollout.max_tokens=40"],
    "code_tests": ["env.tasks.n=4", "rollout.max_tokens=40"],
    "gym_text": ["env.tasks.n=4", "rollout.max_turns=3", "rollout.max_tokens=200"],
}


@pytest.mark.parametrize("name", list(SHORT))
def test_one_training_step(tmp_path, terse_model_dir, name):
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            f"examples/{name}.yaml",
            f"output_dir={out}",
            "train.steps=1",
            f"model.path={terse_model_dir}",
            "rollout.group_size=2",
            "rollout.tasks_per_step=2",
            "rollout.max_new_tokens=12",
            "log.progress=false",
            "log.tensorboard=false",
            *SHORT[name],
        ]
    )
    assert rc == 0
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert metrics["step"] == 1 and math.isfinite(metrics["loss"]) and metrics["unscorable"] == 0
    rows = read_jsonl(out / "trajectories.jsonl")
    assert len(rows) == 4 and all(math.isfinite(r["reward"]) for r in rows)
    assert all(sum(r["loss_mask"]) > 0 and len(r["token_ids"]) == len(r["loss_mask"]) for r in rows)
    # the env scored episodes (python_math and code_tests through the sandbox and verifiers;
    # gym_text ends on the random model's unparseable replies as parse_error)
    assert any(r["stop_reason"] in ("completed", "parse_error") for r in rows)
    assert all(
        r["stop_reason"] in ("completed", "parse_error", "max_tokens", "max_turns") for r in rows
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_one_step_with_the_embedded_model(tmp_path, name):
    """Each env's example config runs a step with the embedded SmolLM2-135M-Instruct (real text,
    real tool calls): nothing is unscorable and every trajectory is well formed."""
    out = tmp_path / "run"
    extra = SHORT.get(name, [])[:1]  # the task count
    rc = main(
        [
            "train",
            f"examples/{name}.yaml",
            f"output_dir={out}",
            "train.steps=1",
            "rollout.group_size=2",
            "rollout.tasks_per_step=2",
            "rollout.max_turns=2",
            "rollout.max_new_tokens=48",
            "rollout.max_tokens=128",
            "log.progress=false",
            "log.tensorboard=false",
            *extra,
        ]
    )
    assert rc == 0
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert (
        math.isfinite(metrics["loss"])
        and metrics["unscorable"] == 0
        and metrics["sampled_tokens"] > 0
    )
    rows = read_jsonl(out / "trajectories.jsonl")
    assert len(rows) == 4 and all(math.isfinite(r["reward"]) for r in rows)


# ---- calculator_steps (turn rewards) ------------------------------------------------------------


def test_calculator_steps_passes_check_env_and_loads_both_splits():
    # not in NAMES: its entry point is declared in pyproject.toml but reaches the metadata only
    # with the next `pip install -e .`; the class is what the entry point names
    from envs.calculator_steps import CalculatorStepsEnv

    check_env(CalculatorStepsEnv())
    train = CalculatorStepsEnv.load_tasks("train", seed=0)
    held_out = CalculatorStepsEnv.load_tasks("eval", seed=0)
    assert train and held_out and {t.id for t in train}.isdisjoint({t.id for t in held_out})
    assert "Example:" in (CalculatorStepsEnv.__doc__ or "")
    assert doctest.testmod(importlib.import_module("envs.calculator_steps")).failed == 0
    with pytest.raises(ValueError, match="tool_reward"):
        CalculatorStepsEnv(tool_reward=2.0)


@pytest.mark.parametrize(
    "script,turn_rewards",
    [
        # the right call, then the right answer: each turn is paid in its own step
        ([call("calculator", expression="EXPR"), "ANSWER"], [0.5, 1.0]),
        # a call whose result is not the answer earns nothing; the answer still does
        ([call("calculator", expression="1 + 1"), "ANSWER"], [0.0, 1.0]),
        # the tool reward is paid once: the same right call again earns 0, no answer earns 0
        ([call("calculator", expression="EXPR")] * 3, [0.5, 0.0, 0.0]),
        # a call the tool refuses (an error message) earns nothing; a wrong answer earns 0
        ([call("calculator", expression="2 / 0"), "7"], [0.0, 0.0]),
        # the right answer without the tool: the answer's reward only
        (["ANSWER"], [1.0]),
    ],
)
def test_calculator_steps_pays_each_turn(chat, script, turn_rewards):
    from envs.calculator_steps import CalculatorStepsEnv

    task = CalculatorStepsEnv.load_tasks("train", seed=0, n=1)[0]
    script = [
        s.replace("EXPR", task.metadata["expression"]).replace("ANSWER", str(task.answer))
        for s in script
    ]
    traj, _ = episode(chat, CalculatorStepsEnv(), task, script, max_turns=3)
    assert list(traj.turn_rewards) == turn_rewards and traj.reward == sum(turn_rewards)
    assert traj.sampled_turn_rewards() == turn_rewards  # one sampled turn per env step here


def test_calculator_steps_example_trains_with_per_turn_advantages(tmp_path, terse_model_dir):
    """One step of examples/calculator_steps.yaml (turn_grpo): every trained row of
    trajectories.jsonl has one turn reward and one turn advantage per sampled turn."""
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "examples/calculator_steps.yaml",
            f"output_dir={out}",
            "train.steps=1",
            f"model.path={terse_model_dir}",
            "rollout.group_size=3",
            "rollout.tasks_per_step=2",
            "rollout.max_new_tokens=12",
            "log.progress=false",
            "log.tensorboard=false",
        ]
    )
    assert rc == 0
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert math.isfinite(metrics["loss"]) and metrics["unscorable"] == 0
    rows = read_jsonl(out / "trajectories.jsonl")
    assert len(rows) == 6
    for r in rows:
        starts = sum(1 for j, m in enumerate(r["loss_mask"]) if m and not r["loss_mask"][j - 1])
        assert len(r["turn_rewards"]) <= starts
        assert r["turn_advantages"] is None or len(r["turn_advantages"]) == starts
    assert any(r["turn_advantages"] is not None for r in rows)
