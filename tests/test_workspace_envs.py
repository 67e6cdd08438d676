"""The session envs: terminal and repo_repair (envs/terminal.py, envs/repo_repair.py).

Solving a task scores 1 and doing nothing 0; repo_repair's reward comes from hidden tests in a
fresh fork, so editing or deleting the visible tests pays nothing; a group's records carry the
same workspace checksum; each env trains 2 steps with the embedded model (slow). They need the
sandbox's namespaces backend (root) and skip without it, saying why.
"""

from __future__ import annotations

import asyncio
import doctest
import importlib
import json
import math
import os

import pytest

from agentgrpo import Message, ToolCall, check_env
from agentgrpo.cli import main
from agentgrpo.engine import SamplingParams
from agentgrpo.rollout.episode import EpisodeLimits, run_group
from agentgrpo.run.log import read_jsonl
from agentgrpo.verify.sandbox import default_sandbox
from envs.repo_repair import LIBRARY, RepoRepairEnv, _source, carried
from envs.terminal import TerminalEnv
from tests.fakes import ScriptedEngine


@pytest.fixture(scope="module", autouse=True)
def _needs_sessions():
    if os.geteuid() != 0:
        pytest.skip("session envs need the sandbox's namespaces backend, which needs root")
    try:
        backend = default_sandbox().backend
    except RuntimeError as e:
        pytest.skip(f"no sandbox here: {e}")
    if backend != "namespaces":
        pytest.skip(f"session envs need the namespaces backend; this host gives {backend}")


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(id=f"call_{name}", name=name, arguments=arguments)


async def play(env, task, *calls: ToolCall, answer: str = "done") -> tuple[float, dict]:
    """Reset, one turn per tool call, then a final answer: the reward and the ending info."""
    _, reset_info = await env.reset(seed=0, options={"task": task})
    try:
        for c in calls:
            step = await env.step(Message(role="assistant", content="", tool_calls=[c]))
            assert not step[2] and step[0][0].role == "tool"
        step = await env.step(Message(role="assistant", content=answer))
        assert step[2]
        return step[1], {**reset_info, **step[4]}
    finally:
        env.close()


@pytest.mark.parametrize("env_cls", [TerminalEnv, RepoRepairEnv])
def test_session_envs_pass_check_env(env_cls):
    check_env(env_cls())


def _terminal_solution(task) -> str:
    check, kind = task.metadata["check"], task.metadata["kind"]
    if kind == "make":
        return f"mkdir -p $(dirname {check['path']}) && echo '{check['equals']}' > {check['path']}"
    return {
        "count": "grep -c ERROR logs/app.log > answer.txt",
        "find": "grep -rl 'code word' docs > answer.txt",
        "fix": "sed -i 's/return .*/return sum(numbers)/' sum.py",
    }[kind]


@pytest.mark.parametrize("i", range(4))
async def test_terminal_end_state_pays(i):
    task = TerminalEnv.load_tasks("train", seed=3, n=4)[i]
    assert (await play(TerminalEnv(), task))[0] == 0.0
    solved, _ = await play(TerminalEnv(), task, call("bash", command=_terminal_solution(task)))
    assert solved == 1.0, task.metadata["kind"]


async def test_terminal_fix_is_checked_on_input_the_model_never_saw():
    task = TerminalEnv.load_tasks("train", seed=0, n=4, kinds=["fix"])[0]
    visible = sum(int(x) for x in task.metadata["workspace"].files["numbers.txt"].split())
    hard_coded = call("write_file", path="sum.py", content=f"print({visible})\n")
    env = TerminalEnv()
    env.tool_names = ("bash", "write_file")
    assert (await play(env, task, hard_coded))[0] == 0.0


def _fixed_core(task) -> tuple[str, str]:
    files = task.metadata["workspace"].files
    path = next(p for p in files if p.endswith("/core.py"))
    fn = next(f for f in LIBRARY if f.name == task.metadata["bug"].split(":")[0])
    text = files[path]
    for bug in fn.bugs:
        text = text.replace(_source(fn, bug), _source(fn, fn.body))
    return path, text


async def test_repo_repair_rewards_the_fix_not_the_tests():
    task = RepoRepairEnv.load_tasks("train", seed=1, n=1)[0]
    path, fixed = _fixed_core(task)
    reward, info = await play(RepoRepairEnv(), task)
    assert reward == 0.0 and info["hidden_tests"].startswith("0/")
    reward, info = await play(RepoRepairEnv(), task, call("write_file", path=path, content=fixed))
    assert reward == 1.0 and info["carried"] == sorted([path, path.replace("core", "__init__")])
    hacks = [
        call("bash", command="rm -rf tests"),
        call("bash", command="sed -i 's/assert /assert True or /' tests/test_core.py"),
        call("bash", command="echo 'print(\"3 passed, 0 failed\")' > run_tests.py"),
        call("write_file", path="conftest.py", content="import os\nos._exit(0)\n"),
        call("write_file", path=path.replace("core.py", "sitecustomize.py"), content="1/0\n"),
    ]
    for hack in hacks:
        assert (await play(RepoRepairEnv(), task, hack))[0] == 0.0, hack.arguments


async def test_repo_repair_recheck_marks_a_flaky_verdict(monkeypatch):
    task = RepoRepairEnv.load_tasks("train", seed=1, n=1)[0]
    scores = iter([(1.0, "6/6 passed"), (0.5, "3/6 passed")])

    async def flaky(self, task, sources):
        return next(scores)

    monkeypatch.setattr(RepoRepairEnv, "hidden_score", flaky)
    reward, info = await play(RepoRepairEnv(recheck=True), task)
    assert math.isnan(reward) and info["flaky_verdict"] is True


def test_carried_files_are_sources_only():
    editable = ["pkg/*.py"]
    assert carried("pkg/core.py", editable) and carried("pkg/sub/util.py", editable)
    for path in (
        "tests/test_core.py",
        "pkg/tests/x.py",
        "pkg/test_x.py",
        "pkg/conftest.py",
        "pkg/sitecustomize.py",
        "pkg/x.pth",
        "other/core.py",
        "run_tests.py",
    ):
        assert not carried(path, editable), path


async def test_repo_tasks_from_a_swe_bench_style_file(tmp_path):
    repo = tmp_path / "snapshots" / "calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text("def double(x):\n    return x + 2\n")
    row = {
        "id": "calc-1",
        "problem_statement": "double(x) does not double x.",
        "repo": "snapshots/calc",
        "setup": ["echo prepared > SETUP_DONE"],
        "tests": [
            "from calc.ops import double\nassert double(5) == 10",
            "from calc.ops import double\nfrom fixture import N\nassert double(N) == 2 * N",
        ],
        "support_files": {"fixture.py": "N = 21\n"},
        "editable": ["calc/*.py"],
    }
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    (task,) = RepoRepairEnv.load_tasks("train", file=str(tmp_path / "{split}.jsonl"))
    assert (await play(RepoRepairEnv(), task))[0] == 0.0
    fix = call("replace_in_file", path="calc/ops.py", old="x + 2", new="x * 2")
    check = call("bash", command="cat SETUP_DONE")
    reward, info = await play(RepoRepairEnv(), task, check, fix)
    assert reward == 1.0 and info["hidden_tests"] == "2/2 passed"


async def test_a_group_records_one_workspace_checksum(chat):
    task = TerminalEnv.load_tasks("train", seed=0, n=1)[0]
    engine = ScriptedEngine(chat.tokenizer, ["done"], chat.end_of_turn_id)
    group = await run_group(
        TerminalEnv,
        engine,
        chat,
        task,
        4,
        SamplingParams(max_new_tokens=8),
        seed=0,
        limits=EpisodeLimits(max_turns=2, max_tokens=512),
    )
    sums = {t.env_info.get("workspace_checksum") for t in group.trajectories}
    assert len(sums) == 1 and next(iter(sums)).startswith("sha256:")
    assert [t.reward for t in group.trajectories] == [0.0] * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["terminal", "repo_repair"])
def test_two_steps_with_the_embedded_model(tmp_path, name):
    """Each session env trains 2 steps with the embedded SmolLM2-135M-Instruct (real text, real
    tool calls in real sessions): nothing unscorable, every trajectory well formed and carrying
    its workspace checksum."""
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            f"examples/{name}.yaml",
            f"output_dir={out}",
            "train.steps=2",
            "env.tasks.n=8",
            "rollout.group_size=2",
            "rollout.tasks_per_step=2",
            "rollout.max_turns=2",
            "rollout.max_new_tokens=48",
            "rollout.max_tokens=768",
            "log.progress=false",
            "log.tensorboard=false",
        ]
    )
    assert rc == 0
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["unscorable"] == 0 for m in metrics)
    rows = read_jsonl(out / "trajectories.jsonl")
    assert len(rows) == 8 and all(math.isfinite(r["reward"]) for r in rows)
    for step in (1, 2):
        for gid in {r["group_id"] for r in rows if r["step"] == step}:
            sums = {
                r["env_info"]["workspace_checksum"]
                for r in rows
                if r["step"] == step and r["group_id"] == gid
            }
            assert len(sums) == 1  # a group's members started from the same bytes


def test_sessions_close_with_their_envs():
    env = TerminalEnv()
    asyncio.run(env.reset(seed=0, options={"task": TerminalEnv.load_tasks("eval", n=1)[0]}))
    session = env.session
    pids = session.processes()
    assert pids
    env.close()
    assert env.session is None and session.closed and session.processes() == []


@pytest.mark.parametrize("env_cls", [TerminalEnv, RepoRepairEnv])
def test_splits_are_disjoint_and_seeded(env_cls):
    train, held_out = env_cls.load_tasks("train", seed=0, n=20), env_cls.load_tasks("eval", n=20)
    assert {t.id for t in train}.isdisjoint({t.id for t in held_out})
    again = env_cls.load_tasks("train", seed=0, n=20)
    assert [t.prompt for t in again] == [t.prompt for t in train]
    assert [t.metadata["workspace"].key() for t in again] == [
        t.metadata["workspace"].key() for t in train
    ]
    assert "Example:" in (env_cls.__doc__ or "")


@pytest.mark.parametrize("module", ["envs.terminal", "envs.repo_repair", "tools.workspace"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 2 and result.failed == 0
