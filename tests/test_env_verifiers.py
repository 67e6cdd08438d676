"""The verifiers adapter (envs/verifiers_env.py) with the real `verifiers` package: environments
written as verifiers' docs show them (tests/data/verifiers/), played through the episode endpoint
token-exactly, scored by their rubric; what does not map is refused; one training step each on the
embedded model.

verifiers needs mcp<2 while the dev venv holds mcp>=2.3, so these tests run in their own venv:
`bash scripts/test-verifiers.sh`. Elsewhere the module is skipped, unless
AGENTGRPO_REQUIRE_VERIFIERS=1 (which that script sets) makes a missing package a failure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import sys

import pytest

from tests.conftest import DATA

if importlib.util.find_spec("verifiers") is None and not os.environ.get(
    "AGENTGRPO_REQUIRE_VERIFIERS"
):
    pytest.skip(
        "needs verifiers (own venv: bash scripts/test-verifiers.sh)", allow_module_level=True
    )

sys.path.insert(0, str(DATA / "verifiers"))  # the test environments, importable by id

from agentgrpo import StopReason  # noqa: E402
from agentgrpo.cli import main  # noqa: E402
from agentgrpo.engine import SamplingParams  # noqa: E402
from agentgrpo.env.base import get_env_class  # noqa: E402
from agentgrpo.rollout.episode import EpisodeLimits, run_group  # noqa: E402
from agentgrpo.run.log import read_jsonl  # noqa: E402
from envs.verifiers_env import VerifiersEnv, load  # noqa: E402
from tests.fakes import ScriptedEngine  # noqa: E402
from tests.test_agent_env import _record_sampled, assert_token_exact, by_turn  # noqa: E402, F401
from tests.test_train_e2e import _check_run_dir  # noqa: E402

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 56, "b": 55}}\n</tool_call>'


def _group(chat, script, task, n=2, max_turns=4):
    engine = ScriptedEngine(chat.tokenizer, script, chat.end_of_turn_id)
    g = asyncio.run(
        run_group(
            VerifiersEnv,
            engine,
            chat,
            task,
            n,
            SamplingParams(max_new_tokens=64, seed=3),
            seed=0,
            limits=EpisodeLimits(max_turns=max_turns, max_tokens=512),
        )
    )
    return g.trajectories, engine


def test_found_by_name_and_tasks_come_from_the_dataset():
    assert get_env_class("verifiers") is VerifiersEnv
    train = VerifiersEnv.load_tasks("train", id="vf_arithmetic", args={"copies": 2})
    assert [t.prompt[0].content for t in train] == ["What is 2+2?", "What is 3*5?"] * 2
    assert [t.answer for t in train] == ["4", "15", "4", "15"]
    assert train[0].id == "vf_arithmetic/train/0"
    evals = VerifiersEnv.load_tasks("eval", id="vf_arithmetic")
    assert [t.answer for t in evals] == ["5"]
    assert len(VerifiersEnv.load_tasks("train", id="vf_arithmetic", n=3)) == 3
    with pytest.raises(ValueError, match="has no eval_dataset"):
        VerifiersEnv.load_tasks("eval", id="vf_calculator")


def test_single_turn_is_token_exact_and_scored_by_its_rubric(chat):
    task = VerifiersEnv.load_tasks("train", id="vf_arithmetic")[0]  # 2+2 -> "4"
    long = "It is five, I think, or maybe more than that."
    trajs, engine = _group(chat, ["It is 4.", long], task)
    by_text = {t.messages[-1].content: t for t in trajs}
    right, wrong = by_text["It is 4."], by_text[long]
    for t in trajs:
        assert t.stop_reason == StopReason.COMPLETED and t.num_turns == 1
    for t in trajs:
        t.check()
        assert not t.earlier_segments
    # correct_answer (weight 1) + short (weight 0.5)
    assert right.reward == 1.5 and wrong.reward == 0.0
    metrics = right.env_info["verifiers"]["metrics"]
    assert metrics == {"correct_answer": 1.0, "short": 1.0, "num_turns": 1.0}
    assert engine.calls[0] == chat.prompt_ids(task.prompt_messages(), None)


def test_tool_env_plays_several_turns_in_one_token_exact_sequence(chat, monkeypatch):
    from agentgrpo.chat.format import ChatFormat

    rendered, real = [], ChatFormat.prompt_ids
    monkeypatch.setattr(
        ChatFormat, "prompt_ids", lambda self, *a, **k: rendered.append(1) or real(self, *a, **k)
    )
    task = VerifiersEnv.load_tasks("train", id="vf_calculator")[0]  # 56 + 55 -> "111"
    trajs, engine = _group(chat, by_turn(chat, CALL, "The answer is 111."), task, n=1)
    (t,) = trajs
    assert t.stop_reason == StopReason.COMPLETED, t.stop_detail
    assert t.num_turns == 2 and t.tool_calls == 1 and not t.earlier_segments
    assert_token_exact(t, engine)
    assert len(rendered) == 1  # verifiers sent its history back as given: continued
    assert [m.role for m in t.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert t.messages[3].content == "111" and t.reward == 1.0
    # the tools verifiers declared reached the template: the prompt lists `add`
    assert '"name": "add"' in chat.decode(engine.calls[0])
    metrics = t.env_info["verifiers"]["metrics"]
    assert metrics["add_calls"] == 1.0 and metrics["num_turns"] == 2.0


def test_our_turn_limit_ends_a_verifiers_episode_as_max_turns(chat):
    task = VerifiersEnv.load_tasks("train", id="vf_calculator")[0]
    trajs, _ = _group(chat, [CALL], task, n=1, max_turns=2)  # calls the tool forever
    (t,) = trajs
    assert t.stop_reason == StopReason.MAX_TURNS and t.num_turns == 2 and t.reward == 0.0


def test_a_reward_function_that_raises_is_unscorable_not_zero(chat, tmp_path, monkeypatch):
    (tmp_path / "vf_broken.py").write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n"
        "def load_environment():\n"
        "    def judge(completion) -> float:\n        raise ConnectionError('judge down')\n"
        "    ds = Dataset.from_list([{'prompt': [{'role': 'user', 'content': 'hi'}], "
        "'answer': 'x'}])\n"
        "    return vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[judge]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = VerifiersEnv.load_tasks("train", id="vf_broken")[0]
    (t,), _ = _group(chat, ["hello"], task, n=1)
    assert t.stop_reason == StopReason.ENV_ERROR and math.isnan(t.reward)
    assert "judge down" in t.stop_detail


def test_what_does_not_map_is_refused_by_name(tmp_path, monkeypatch):
    (tmp_path / "vf_grouped.py").write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n"
        "def load_environment():\n"
        "    def rank(completions) -> list[float]:\n        return [0.0] * len(completions)\n"
        "    ds = Dataset.from_list([{'prompt': [{'role': 'user', 'content': 'hi'}]}])\n"
        "    return vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[rank]))\n"
        "\n"
        "class NotAnEnv:  # what a v1 environment is to the v0 API\n"
        '    env_id, env_args = "", {}\n'
    )
    (tmp_path / "vf_other.py").write_text(
        "from vf_grouped import NotAnEnv\ndef load_environment():\n    return NotAnEnv()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="group reward functions"):
        load("vf_grouped")
    with pytest.raises(ValueError, match="returned NotAnEnv, not a vf.Environment"):
        load("vf_other")


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["vf_arithmetic", "vf_calculator"])
def test_one_training_step_on_the_embedded_model(tmp_path, smol_path, env_id):
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "examples/calculator.yaml",
            f"output_dir={out}",
            f"model.path={smol_path}",
            "env.name=verifiers",
            f"env.tasks={{id: {env_id}}}",
            "train.steps=1",
            "rollout.group_size=2",
            "rollout.tasks_per_step=2",
            "rollout.max_new_tokens=40",
            "rollout.max_tokens=120",
            "log.progress=false",
        ]
    )
    assert rc == 0
    _check_run_dir(out, 1)  # token-exact rows, finite loss and reward
    rows = read_jsonl(out / "trajectories.jsonl")
    assert all(r["task_id"].startswith(env_id) for r in rows)
    assert all("verifiers" in r["env_info"] for r in rows if r["stop_reason"] == "completed")
