"""Evaluation: the pass@k estimator by hand, metrics that skip unscorable samples, and the run
directory `agentgrpo eval` writes (scripted engine, real tokenizer)."""

import json
import math
import re
from collections import Counter

import pytest

from agentgrpo.config import load_config
from agentgrpo.engine.base import EngineError
from agentgrpo.evaluate import EvalConfig, pass_at_k, resolve_weights, run_eval
from agentgrpo.log import read_jsonl
from tests.fakes import ScriptedEngine


@pytest.mark.parametrize("n, c, k, want", [
    (4, 1, 1, 0.25),               # c/n
    (4, 1, 2, 0.5),                # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 2, 2, 5 / 6),              # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (5, 2, 3, 0.9),                # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (4, 0, 3, 0.0),
    (4, 4, 1, 1.0),
    (3, 2, 2, 1.0),                # n - c < k: every draw of 2 holds a pass
])
def test_pass_at_k_by_hand(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_pass_at_k_matches_the_binomial_formula_and_rejects_nonsense():
    for n in range(1, 30):
        for c in range(n + 1):
            for k in (1, 2, 5, 10):
                if k <= n:
                    want = 1 - math.comb(n - c, k) / math.comb(n, k)
                    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="pass_k"):
        EvalConfig(samples_per_task=2, pass_k=[1, 4])


def test_run_eval_writes_a_run_like_directory(tmp_path, smol_tokenizer):
    """3 calculator tasks x 4 samples. Task k is answered right by its first k samples; the 4th
    sample of task 2 hits an engine failure (unscorable, left out of n)."""
    asked: Counter = Counter()

    def script(ids, i):
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", smol_tokenizer.decode(ids))[-1])  # not the demo
        task = order.index((a, b))
        asked[task] += 1
        if task == 2 and asked[task] == 4:
            return EngineError("server gone")
        return str(a + b) if asked[task] <= task else "0"

    from envs.calculator import CalculatorEnv

    order = [tuple(map(int, t.metadata["expression"].split(" + ")))
             for t in CalculatorEnv.load_tasks("eval", seed=0, n=3)]
    cfg = load_config(None, ["env.name=calculator", f"output_dir={tmp_path}", "eval.num_tasks=3",
                             "eval.samples_per_task=4", "eval.pass_k=[1,2]", "eval.checkpoint=none"])
    engine = ScriptedEngine(smol_tokenizer, script, smol_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    out_dir, result = run_eval(cfg, engine=engine)
    m = result.metrics
    # per task (n, c): (4, 0), (4, 1), (3, 2)
    assert m["pass@1"] == pytest.approx((0 + 1 / 4 + 2 / 3) / 3)
    assert m["pass@2"] == pytest.approx((0 + 0.5 + 1.0) / 3)  # task 1: 1 - C(3,2)/C(4,2); task 2: n-c < k
    assert m["reward_mean"] == pytest.approx(3 / 11) and m["unscorable"] == 1
    assert m["stop/completed"] == 11 and m["stop/engine_error"] == 1 and m["pass@2/tasks"] == 3
    rows = read_jsonl(out_dir / "trajectories.jsonl")
    assert len(rows) == 12 and {r["step"] for r in rows} == {0}
    assert {"step", "group_id", "token_ids", "loss_mask", "logprobs", "messages", "stop_reason", "reward"} <= set(rows[0])
    assert [r["step"] for r in read_jsonl(out_dir / "metrics.jsonl")] == [0]
    summary = json.loads((out_dir / "eval.json").read_text())
    assert [(t["scored"], t["passed"]) for t in summary["tasks"]] == [(4, 0), (4, 1), (3, 2)]


def test_latest_checkpoint_is_evaluated_by_default(tmp_path):
    from agentgrpo import checkpoint

    def payload(d):
        for f in ("model.safetensors", "learner.pt"):
            (d / f).write_bytes(b"weights")

    ckpt = checkpoint.save(tmp_path / "checkpoints", 3, payload, {"data_position": 0})
    cfg = load_config(None, [f"output_dir={tmp_path}"])
    assert resolve_weights(cfg, tmp_path / "base") == (ckpt, 3)
    cfg = load_config(None, [f"output_dir={tmp_path / 'fresh'}"])
    assert resolve_weights(cfg, tmp_path / "base") == (tmp_path / "base", 0)


def test_eval_refuses_a_template_that_is_not_token_safe(tmp_path, capsys):
    from agentgrpo.cli import main
    from tests.conftest import SHARED, shared_template

    shared_template("qwen3.jinja")  # skips when shared/ is absent
    rc = main(["eval", str(_empty_config(tmp_path)), f"output_dir={tmp_path}",
               f"model.chat_template={SHARED / 'chat_templates' / 'qwen3.jinja'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "not token-safe for this environment" in err and "template_fallback=keep_history" in err


def _empty_config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("env: {name: calculator}\n")
    return path
