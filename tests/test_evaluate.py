"""Evaluation: the pass@k estimator by hand, metrics that skip unscorable samples, the run
directory `agentgrpo eval` writes (scripted engine, real tokenizer), and the weights it evaluates:
every checkpoint format the trainer writes (full, sharded, LoRA adapter, sharded LoRA, shards of 2
FSDP ranks) reaches the engine, local or SGLang, as the trained weights."""

import json
import math
import re
from collections import Counter

import pytest
import torch

from agentgrpo.engine.base import EngineError
from agentgrpo.run.config import load_config
from agentgrpo.run.evaluate import EvalConfig, pass_at_k, resolve_policy, run_eval
from agentgrpo.run.log import read_jsonl
from envs.calculator import CalculatorEnv
from tests.fakes import ScriptedEngine


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (4, 1, 1, 0.25),  # c/n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (4, 0, 3, 0.0),
        (4, 4, 1, 1.0),
        (3, 2, 2, 1.0),  # n - c < k: every draw of 2 holds a pass
    ],
)
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
        a, b = map(
            int, re.findall(r"What is (\d+) \+ (\d+)\?", smol_tokenizer.decode(ids))[-1]
        )  # not the demo
        task = order.index((a, b))
        asked[task] += 1
        if task == 2 and asked[task] == 4:
            return EngineError("server gone")
        return str(a + b) if asked[task] <= task else "0"

    from envs.calculator import CalculatorEnv

    order = [
        tuple(map(int, t.metadata["expression"].split(" + ")))
        for t in CalculatorEnv.load_tasks("eval", seed=0, n=3)
    ]
    cfg = load_config(
        None,
        [
            "env.name=calculator",
            f"output_dir={tmp_path}",
            "eval.num_tasks=3",
            "eval.samples_per_task=4",
            "eval.pass_k=[1,2]",
            "eval.checkpoint=none",
        ],
    )
    engine = ScriptedEngine(
        smol_tokenizer, script, smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    out_dir, result = run_eval(cfg, engine=engine)
    m = result.metrics
    # per task (n, c): (4, 0), (4, 1), (3, 2)
    assert m["pass@1"] == pytest.approx((0 + 1 / 4 + 2 / 3) / 3)
    assert m["pass@2"] == pytest.approx(
        (0 + 0.5 + 1.0) / 3
    )  # task 1: 1 - C(3,2)/C(4,2); task 2: n-c < k
    assert m["reward_mean"] == pytest.approx(3 / 11) and m["unscorable"] == 1
    assert m["stop/completed"] == 11 and m["stop/engine_error"] == 1 and m["pass@2/tasks"] == 3
    rows = read_jsonl(out_dir / "trajectories.jsonl")
    assert len(rows) == 12 and {r["step"] for r in rows} == {0}
    assert {
        "step",
        "group_id",
        "token_ids",
        "loss_mask",
        "logprobs",
        "messages",
        "stop_reason",
        "reward",
    } <= set(rows[0])
    assert [r["step"] for r in read_jsonl(out_dir / "metrics.jsonl")] == [0]
    summary = json.loads((out_dir / "eval.json").read_text())
    assert [(t["scored"], t["passed"]) for t in summary["tasks"]] == [(4, 0), (4, 1), (3, 2)]

    # a second evaluation into the same directory replaces the first (its files used to append)
    cfg2 = load_config(
        None,
        [
            "env.name=calculator",
            f"output_dir={tmp_path}",
            "eval.num_tasks=3",
            "eval.samples_per_task=2",
            "eval.checkpoint=none",
        ],
    )
    run_eval(
        cfg2,
        engine=ScriptedEngine(
            smol_tokenizer, lambda ids, i: "0", smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
        ),
    )
    assert len(read_jsonl(out_dir / "trajectories.jsonl")) == 6
    assert [r["step"] for r in read_jsonl(out_dir / "metrics.jsonl")] == [0]


def test_eval_refuses_a_template_that_is_not_token_safe(tmp_path, capsys):
    from agentgrpo.cli import main
    from tests.conftest import template_file

    rc = main(
        [
            "eval",
            str(_empty_config(tmp_path)),
            f"output_dir={tmp_path}",
            "rollout.trajectory_mode=single",
            f"model.chat_template={template_file('qwen3.jinja')}",
        ]
    )
    err = capsys.readouterr().err
    assert (
        rc == 2
        and "not token-safe for this environment" in err
        and "template_fallback=keep_history" in err
    )


def _empty_config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("env: {name: calculator}\n")
    return path


# --- the weights evaluated: every checkpoint format ---------------------------------------------

LORA = ["learner.lora.r=4", "loss.kl_coef=0.1", "learner.lr=1e-2"]
SHARDED = ["learner.checkpoint_format=sharded"]
RUNS = {"full": [], "sharded": SHARDED, "lora": LORA, "lora-sharded": [*LORA, *SHARDED]}
SAME_TRAINING = {
    "full": "full",
    "sharded": "full",
    "lora": "lora",
    "lora-sharded": "lora",
}  # the format aside


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stopping_model_dir):
    """One trained step per checkpoint format, all else equal: run directory and overrides. The
    runs are deterministic (`deterministic=true`), so two formats' runs train bit-identical weights
    (the engine's batching changed their last bits otherwise, and the test failed under load)."""
    from tests.short_runs import train_exactly

    out = {}
    for name, extra in RUNS.items():
        d = tmp_path_factory.mktemp(name)
        assert train_exactly(d, stopping_model_dir, 1, *extra) == 0
        out[name] = (d, extra)
    return out


def _eval_overrides(run_dir, model_dir, extra, *more):
    return [
        f"output_dir={run_dir}",
        f"model.path={model_dir}",
        "env.name=tests.short_runs:VariedRewardEnv",
        "env.audit.reward_hacks=skip",  # a toy verifier: not what this tests
        "rollout.max_new_tokens=12",
        "rollout.max_tokens=40",
        "eval.num_tasks=2",
        "eval.samples_per_task=2",
        f"eval.output_dir={run_dir / 'eval-out'}",
        *extra,
        *more,
    ]


def _eval_cfg(run_dir, model_dir, extra, *more):
    return load_config(
        "examples/calculator.yaml", _eval_overrides(run_dir, model_dir, extra, *more)
    )


def _tokens(result):
    return [(t.group_id, list(t.token_ids)) for g in result.groups for t in g.trajectories]


def _trained_reference(run_dir, model_dir):
    """The weights training produced, read without agentgrpo: the full checkpoint's safetensors, or
    peft's own merge of the LoRA adapter into the base model."""
    from safetensors.torch import load_file

    ckpt = run_dir / "checkpoints" / "step-000001"
    if (ckpt / "model.safetensors").is_file():
        return load_file(ckpt / "model.safetensors")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, ckpt).merge_and_unload().state_dict()


def test_eval_serves_the_trained_weights_of_every_checkpoint_format(runs, stopping_model_dir):
    """The local engine (built from the base model) ends up holding the trained weights, whatever
    the format: equal to the weights file of the full checkpoint (full; sharded, which trained
    alike) or to peft's merge of the adapter (LoRA; sharded LoRA), and the runs that trained alike
    sample alike."""
    from agentgrpo.engine.local.engine import LocalEngine
    from agentgrpo.models.embedded import load_model

    base = load_model(stopping_model_dir).state_dict()
    served, tokens = {}, {}
    for name, (run_dir, extra) in runs.items():
        # one sequence at a time, no prefix cache: sampling does not depend on what runs beside it
        engine = LocalEngine(stopping_model_dir, max_batch_size=1, prefix_cache_tokens=0)
        try:
            out_dir, result = run_eval(_eval_cfg(run_dir, stopping_model_dir, extra), engine=engine)
            served[name] = {k: v.clone() for k, v in engine.model.state_dict().items()}
        finally:
            engine.close()
        tokens[name] = _tokens(result)
        assert json.loads((out_dir / "eval.json").read_text())["step"] == 1
        assert {t.weight_versions for g in result.groups for t in g.trajectories} == {(1,)}
        reference = _trained_reference(runs[SAME_TRAINING[name]][0], stopping_model_dir)
        for key, t in reference.items():
            torch.testing.assert_close(
                served[name][key], t, atol=1e-6, rtol=1e-5, msg=f"{name}: {key}"
            )
        moved = [k for k in reference if not torch.equal(reference[k], base[k])]
        assert moved, f"{name}: one step changed no weight, the test would prove nothing"
    for a, b in (("full", "sharded"), ("lora", "lora-sharded")):
        for key, t in served[a].items():
            assert torch.equal(served[b][key], t), f"{b} vs {a}: {key}"
        assert tokens[a] == tokens[b]


def test_the_eval_command_evaluates_a_sharded_lora_checkpoint(
    runs, stopping_model_dir, capsys, tmp_path
):
    """`agentgrpo eval` end to end (engine built from the config): the newest checkpoint of a run
    with LoRA and sharded checkpoints samples what the same adapter in the full format does."""
    from agentgrpo.cli import main

    lora_dir, lora = runs["lora"]
    _, expected = run_eval(_eval_cfg(lora_dir, stopping_model_dir, lora, "eval.checkpoint=none"))
    _, want = run_eval(_eval_cfg(lora_dir, stopping_model_dir, lora))
    assert _tokens(want) != _tokens(expected)  # the adapter changes what is sampled
    run_dir, extra = runs["lora-sharded"]
    overrides = _eval_overrides(run_dir, stopping_model_dir, extra, f"eval.output_dir={tmp_path}")
    assert main(["eval", "examples/calculator.yaml", *overrides]) == 0
    assert "step-000001 (step 1)" in capsys.readouterr().out
    rows = read_jsonl(tmp_path / "trajectories.jsonl")
    assert sorted((r["group_id"], r["token_ids"]) for r in rows) == sorted(_tokens(want))


def _get_weight(url, name):
    import urllib.request

    req = urllib.request.Request(
        f"{url}/get_weights_by_name",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return torch.tensor(json.loads(r.read()))


def test_sglang_servers_get_the_evaluated_weights_pushed(runs, stopping_model_dir, tmp_path):
    """With SGLang the servers may hold any weights: eval pushes the checkpoint's (here a sharded
    LoRA one, merged) through weight sync and verifies them, and pushes the base model back for
    eval.checkpoint=none."""
    from tests.fake_sglang import FakeSGLangProcess

    run_dir, extra = runs["lora-sharded"]
    key = "model.layers.0.self_attn.q_proj.weight"
    trained = _trained_reference(runs["lora"][0], stopping_model_dir)[key]
    with FakeSGLangProcess("--backend", "model", "--model-path", str(stopping_model_dir)) as server:
        initial = _get_weight(server.url, key)
        assert not torch.allclose(initial, trained, atol=1e-4)
        sglang = [
            "engine.kind=sglang",
            f"engine.sglang.urls=[{server.url}]",
            f"weight_sync.shared_dir={tmp_path}",
            "eval.num_tasks=1",
            "rollout.max_turns=1",
        ]  # the fake's model has no KV cache: keep it short
        _, result = run_eval(_eval_cfg(run_dir, stopping_model_dir, extra, *sglang))
        torch.testing.assert_close(_get_weight(server.url, key), trained, atol=1e-6, rtol=1e-5)
        assert [p.name for p in tmp_path.iterdir()] == [
            "eval"
        ]  # a training run's step_<N> stay its own
        assert {t.weight_versions for g in result.groups for t in g.trajectories} == {(1,)}
        _, result = run_eval(
            _eval_cfg(run_dir, stopping_model_dir, extra, *sglang, "eval.checkpoint=none")
        )
        torch.testing.assert_close(_get_weight(server.url, key), initial, atol=0, rtol=0)
        assert {t.weight_versions for g in result.groups for t in g.trajectories} == {(0,)}


def _copy_run(run, tmp_path):
    import shutil

    run_dir, extra = run
    copy = tmp_path / "run"
    shutil.copytree(run_dir / "checkpoints", copy / "checkpoints")
    return copy, extra


def test_damaged_and_mismatched_checkpoints_are_refused_never_replaced_by_the_base(
    runs, stopping_model_dir, tmp_path
):
    from agentgrpo.run import checkpoint
    from agentgrpo.run.config import ConfigError

    run_dir, extra = _copy_run(runs["sharded"], tmp_path)
    first = run_dir / "checkpoints" / "step-000001"
    second = run_dir / "checkpoints" / "step-000002"
    import shutil

    shutil.copytree(first, second)
    manifest = json.loads((second / checkpoint.MANIFEST).read_text())
    (second / checkpoint.MANIFEST).write_text(json.dumps({**manifest, "step": 2}))
    cfg = _eval_cfg(run_dir, stopping_model_dir, extra)
    assert resolve_policy(cfg, stopping_model_dir)[:2] == (second, 2)
    shard = next((second / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="step-000002"):  # as resume does: the previous one
        assert resolve_policy(cfg, stopping_model_dir)[:2] == (first, 1)
    named = _eval_cfg(run_dir, stopping_model_dir, extra, f"eval.checkpoint={second}")
    with pytest.raises(
        ConfigError, match="not an intact checkpoint: .*does not match its checksum"
    ):
        resolve_policy(named, stopping_model_dir)
    (first / "learner.pt").unlink()
    with (
        pytest.warns(UserWarning),
        pytest.raises(ConfigError, match="no checkpoint .* verifies and loads"),
    ):
        resolve_policy(cfg, stopping_model_dir)
    fresh = _eval_cfg(tmp_path / "fresh", stopping_model_dir, extra)
    with pytest.raises(
        ConfigError, match=r"no checkpoint under .*fresh/checkpoints.*eval.checkpoint=none"
    ):
        resolve_policy(
            fresh, stopping_model_dir
        )  # a misspelt output_dir: never the base model instead

    for name in ("lora", "lora-sharded"):  # the config must say LoRA, as training's did
        ckpt = runs[name][0] / "checkpoints" / "step-000001"
        plain = _eval_cfg(runs[name][0], stopping_model_dir, [], f"eval.checkpoint={ckpt}")
        with pytest.raises(ConfigError, match="holds LoRA adapters but learner.lora is None"):
            resolve_policy(plain, stopping_model_dir)
    ckpt = runs["full"][0] / "checkpoints" / "step-000001"
    with pytest.raises(ConfigError, match="holds full weights but learner.lora is"):
        resolve_policy(
            _eval_cfg(runs["full"][0], stopping_model_dir, LORA, f"eval.checkpoint={ckpt}"),
            stopping_model_dir,
        )


class _Planted:
    """Unpickling this creates the file `path` (what a planted checkpoint could do instead)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _plant_metadata(checkpoint_dir, marker):
    """Replace the checkpoint's DCP `.metadata` with one that runs code when unpickled, and rewrite
    its manifest to match, as whoever planted it would: the checksums verify."""
    import hashlib
    import pickle

    from agentgrpo.run import checkpoint

    meta = checkpoint_dir / "dcp" / ".metadata"
    meta.write_bytes(pickle.dumps(_Planted(marker)))
    manifest = json.loads((checkpoint_dir / checkpoint.MANIFEST).read_text())
    manifest["files"]["dcp/.metadata"] = {
        "bytes": meta.stat().st_size,
        "sha256": hashlib.sha256(meta.read_bytes()).hexdigest(),
    }
    (checkpoint_dir / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    checkpoint.verify(checkpoint_dir)


def test_a_planted_checkpoint_runs_no_code_in_eval_or_resume(runs, stopping_model_dir, tmp_path):
    """Finding 1 of issue 33: DCP's `.metadata` is a pickle, and torch's reader unpickles it. A
    checkpoint whose metadata would create a file is refused, by eval (named or latest) and by a
    resume (in the sharded format, and in the full format, where only the `dcp/` folder chooses
    the reader), with an error naming what it asked for; no file appears."""
    from agentgrpo.learner.state import UnsafeCheckpoint
    from agentgrpo.run.config import ConfigError
    from tests.short_runs import train

    marker = tmp_path / "pwned"
    for name in ("sharded", "lora-sharded"):
        run_dir, extra = _copy_run(runs[name], tmp_path / name)
        ckpt = run_dir / "checkpoints" / "step-000001"
        _plant_metadata(ckpt, marker)
        named = _eval_cfg(run_dir, stopping_model_dir, extra, f"eval.checkpoint={ckpt}")
        with pytest.raises(UnsafeCheckpoint, match="names io.open, which is not one of DCP"):
            resolve_policy(named, stopping_model_dir)
        with (
            pytest.warns(UserWarning, match="UnsafeCheckpoint: .*io.open"),
            pytest.raises(ConfigError, match="no checkpoint .* verifies and loads"),
        ):
            resolve_policy(_eval_cfg(run_dir, stopping_model_dir, extra), stopping_model_dir)
        for formats in (extra, [x for x in extra if "checkpoint_format" not in x]):
            assert (
                train(run_dir, stopping_model_dir, 2, *formats) == 2
            )  # refused: no usable checkpoint
        assert not marker.exists()


def test_dcp_metadata_naming_files_outside_its_directory_is_refused(tmp_path):
    """DCP's metadata names the data file of each tensor; one naming a path outside the
    checkpoint (`../x`) is refused before anything is read, and an honest one loads."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from agentgrpo.learner.state import UnsafeCheckpoint, _dcp_load

    model = torch.nn.Linear(3, 2)
    with pytest.warns(UserWarning):  # torch: no process group, saving as one process
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    state = {"model": torch.nn.Linear(3, 2).state_dict()}
    _dcp_load(state, tmp_path / "dcp", no_dist=True)
    torch.testing.assert_close(state["model"]["weight"], model.weight.detach())
    meta_file = tmp_path / "dcp" / ".metadata"
    meta = pickle.loads(meta_file.read_bytes())  # our own file: trusted here
    for info in meta.storage_data.values():
        info.relative_path = "../secret.distcp"
    meta_file.write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeCheckpoint, match="names data file '../secret.distcp' outside"):
        _dcp_load(state, tmp_path / "dcp", no_dist=True)


def _fsdp_sharded_checkpoint(rank: int, tmp: str) -> None:
    from pathlib import Path

    from agentgrpo.learner.learner import Learner
    from tests.test_distributed import CFG, LOSS, _fsdp_accelerator, _steps
    from tests.test_learner import TEMPERATURE
    from tests.tiny import tiny_llama

    cfg = CFG.model_copy(update={"checkpoint_format": "sharded"})
    learner = Learner(
        tiny_llama(), cfg, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator()
    )
    _steps(learner, 1)
    learner.save(Path(tmp) / "ckpt")
    exported = learner.export_model()
    if rank == 0:
        torch.save(exported.state_dict(), Path(tmp) / "trained.pt")


def test_shards_of_two_fsdp_ranks_load_into_one_process_without_a_process_group(tmp_path):
    from agentgrpo.learner import state as learner_state
    from agentgrpo.learner.logprobs import PolicyForward
    from tests.ranks import spawn_gloo
    from tests.tiny import tiny_llama

    spawn_gloo(_fsdp_sharded_checkpoint, str(tmp_path))
    assert len(list((tmp_path / "ckpt" / "dcp").glob("*.distcp"))) == 2
    model = tiny_llama()
    assert not torch.distributed.is_initialized()
    learner_state.load_weights(PolicyForward(model), tmp_path / "ckpt", lora=False)
    trained = torch.load(tmp_path / "trained.pt")
    assert any(not torch.equal(t, tiny_llama().state_dict()[k]) for k, t in trained.items())
    for key, t in trained.items():
        assert torch.equal(model.state_dict()[key], t), key


class NoEvalTasks(CalculatorEnv):
    """The calculator with an empty eval split (here, so `env.name` can name it)."""

    @classmethod
    def load_tasks(cls, split, seed=0, **kwargs):
        return [] if split == "eval" else super().load_tasks(split, seed=seed, **kwargs)


def test_an_empty_eval_split_is_a_config_error_for_eval_and_train(tmp_path, capsys, tiny_model_dir):
    from agentgrpo.cli import main

    env = "env.name=tests.test_evaluate:NoEvalTasks"
    assert main(["eval", str(_empty_config(tmp_path)), f"output_dir={tmp_path}", env]) == 2
    assert "has no tasks in split 'eval'" in capsys.readouterr().err  # was a traceback
    # training with eval.every used to log NaN eval metrics every few steps instead
    rc = main(
        [
            "train",
            "examples/calculator.yaml",
            f"output_dir={tmp_path / 'run'}",
            "train.steps=1",
            f"model.path={tiny_model_dir}",
            env,
            "eval.every=1",
            "log.progress=false",
            "log.tensorboard=false",
        ]
    )
    assert rc == 2 and "eval.every=1 but" in capsys.readouterr().err
