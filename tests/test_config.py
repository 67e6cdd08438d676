import pytest

from agentgrpo.run.config import ConfigError, dump_config, load_config


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  grup_size: 4\n")
    with pytest.raises(ConfigError, match=r"rollout\.grup_size: unknown key"):
        load_config(p)


def test_overrides_are_typed_and_validated(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: 5\n")
    cfg = load_config(p, ["train.steps=2", "output_dir=runs/x", "rollout.temperature=0.7"])
    assert cfg.train.steps == 2 and cfg.output_dir == "runs/x" and cfg.rollout.temperature == 0.7
    with pytest.raises(ConfigError, match=r"train\.stepz: unknown key"):
        load_config(p, ["train.stepz=3"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        load_config(p, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match="must look like"):
        load_config(p, ["train.steps"])


def test_example_configs_load():
    from pathlib import Path

    for f in sorted(Path(__file__).parents[1].glob("examples/**/*.yaml")):
        load_config(f)


def test_secrets_are_masked():
    from agentgrpo.run.log import mask_secrets

    assert mask_secrets({"a": {"api_key": "sk-1", "n": 1}, "token": "t"}) == {
        "a": {"api_key": "***", "n": 1},
        "token": "***",
    }
    assert mask_secrets({"HF-Token": "hf_x", "apiKey": "k", "row_tokens": "auto"}) == {
        "HF-Token": "***",
        "apiKey": "***",
        "row_tokens": "auto",
    }
    assert "***" not in dump_config(load_config(None))
    # plural keys, lists and dicts below a secret key, HTTP credentials anywhere (these were kept)
    assert mask_secrets(
        {
            "api_keys": ["sk-2", "sk-3"],
            "credentials": {"user": "u", "pw": "p"},
            "judge": {"headers": {"Authorization": "Bearer sk-4", "X": "Token abc"}},
            "cookie": "s=1",
            "max_tokens": 7,
        }
    ) == {
        "api_keys": ["***", "***"],
        "credentials": {"user": "***", "pw": "***"},
        "judge": {"headers": {"Authorization": "***", "X": "***"}},
        "cookie": "***",
        "max_tokens": 7,
    }


def test_secret_masking_catches_what_it_once_missed():
    """Issue 33: keys named passwd, pass, bearer, signature; API-key-looking values under any
    name; credentials inside URLs (engine.sglang.urls) were written in clear."""
    from agentgrpo.run.log import mask_secrets

    assert mask_secrets(
        {
            "passwd": "p1",
            "db_pass": "p2",
            "bearer": "b",
            "X-Amz-Signature": "s",
            "eval": {"pass_k": [1, 4]},
            "learner": {"passes": 2},
        }
    ) == {
        "passwd": "***",
        "db_pass": "***",
        "bearer": "***",
        "X-Amz-Signature": "***",
        "eval": {"pass_k": [1, 4]},
        "learner": {"passes": 2},
    }  # numbers are never secrets
    assert mask_secrets(
        {
            "judge_model": "sk-proj-abcdefghijklmnop0123",
            "note": "hf_abcdefghijklmnopqrstu",
            "name": "sk-2",
            "tag": "task-abcdefghijklmnopq",
        }
    ) == {"judge_model": "***", "note": "***", "name": "sk-2", "tag": "task-abcdefghijklmnopq"}
    assert mask_secrets(
        [
            "https://user:hunter2@box:8765/run?api_key=zz&n=3&token=",
            "http://h:1",
            "see http://h/a@b",
        ]
    ) == ["https://***@box:8765/run?api_key=***&n=3&token=", "http://h:1", "see http://h/a@b"]
    cfg = load_config(
        "examples/calculator.yaml",
        [
            "engine.kind=sglang",
            "engine.sglang.urls=[http://admin:hunter2@h:1, http://h:2]",
            "env.kwargs={note: 'sk-abcdefghijklmnop0123'}",
        ],
    )
    dumped = dump_config(cfg)
    assert "hunter2" not in dumped and "sk-abcdef" not in dumped and "http://***@h:1" in dumped


def _alias_bomb(levels: int) -> str:
    """A config whose env.kwargs hold `levels` lists of nine aliases of the list before (9**levels
    strings in a few hundred bytes)."""
    lines = ["env:", "  name: calculator", "  kwargs:", "    l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bombs_are_refused_quickly(tmp_path):
    """Issue 33: a 373-byte config with nested aliases took 103 s to dump as an 18 MB config.yaml
    (one level more did not finish). Its expanded size is bounded when it loads, in a time that
    does not grow with the expansion; a few honest anchors still load."""
    import time

    for levels in (6, 30):  # 9**6 = 531441 values, 9**30 about 4e28
        bomb = tmp_path / f"bomb{levels}.yaml"
        bomb.write_text(_alias_bomb(levels))
        start = time.monotonic()
        with pytest.raises(
            ConfigError, match=f"{bomb}: expands to over 100000 values through YAML"
        ):
            load_config(bomb)
        assert time.monotonic() - start < 2
    with pytest.raises(ConfigError, match="expands to over"):
        load_config(
            "examples/calculator.yaml",
            [f"env.kwargs={{a: &a [{', '.join(['x'] * 400)}], b: [{', '.join(['*a'] * 400)}]}}"],
        )
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text("env:\n  name: calculator\n  kwargs: {a: &a [*a]}\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(cycle)
    honest = tmp_path / "honest.yaml"
    honest.write_text(_alias_bomb(2))  # 9 aliases of a list of 9: 90 values
    assert len(load_config(honest).env.kwargs["l1"]) == 9
    assert "l1:" in dump_config(load_config(honest))


def test_local_engine_settings_with_sglang_are_refused_not_ignored():
    sglang = ["engine.kind=sglang", "engine.sglang={urls: [http://h:1]}"]
    for extra in ("engine.max_batch_size=2", "engine.prefix_cache_tokens=0", "engine.device=cpu"):
        with pytest.raises(ConfigError, match=f"{extra} configure the local engine"):
            load_config("examples/calculator.yaml", [*sglang, extra])
    cfg = load_config("examples/calculator.yaml", sglang)
    assert (
        load_config(
            None,
            [
                f"{k}={v}"
                for k, v in [
                    ("engine.kind", "sglang"),
                    ("engine.max_batch_size", cfg.engine.max_batch_size),
                ]
            ]
            + sglang[1:],
        ).engine.kind
        == "sglang"
    )  # its own defaults, as config.yaml has them


def test_engine_device_is_auto_or_a_torch_device():
    assert load_config("examples/calculator.yaml").engine.device == "auto"
    for device in ("cpu", "cuda", "cuda:1"):  # checked as names: no GPU needed to load a config
        assert load_config("examples/calculator.yaml", [f"engine.device={device}"]).engine.device
    with pytest.raises(ConfigError, match=r"engine.device='gpu' is not a torch device"):
        load_config("examples/calculator.yaml", ["engine.device=gpu"])


def test_wandb_names_without_a_project_are_refused_not_ignored():
    with pytest.raises(
        ConfigError, match="log.wandb_entity, log.wandb_name set without log.wandb_project"
    ):
        load_config(None, ["log.wandb_entity=team", "log.wandb_name=r1"])


def test_more_mini_batches_than_groups_per_step_is_refused():
    with pytest.raises(ConfigError, match="learner.mini_batches=8"):
        load_config(
            "examples/calculator.yaml", ["learner.mini_batches=8", "rollout.tasks_per_step=4"]
        )
    ok = load_config(
        "examples/calculator.yaml", ["learner.mini_batches=4", "rollout.tasks_per_step=4"]
    )
    assert ok.learner.mini_batches == 4


def test_a_row_cap_without_shared_prefix_is_refused():
    with pytest.raises(ConfigError, match="row_tokens=512 caps shared-prefix rows"):
        load_config(
            "examples/calculator.yaml", ["learner.row_tokens=512", "learner.packing=packed"]
        )
    with pytest.raises(ConfigError, match="row_tokens"):
        load_config("examples/calculator.yaml", ["learner.row_tokens=8"])
    assert (
        load_config("examples/calculator.yaml", ["learner.row_tokens=512"]).learner.row_tokens
        == 512
    )


def test_tis_needs_recomputed_old_logprobs():
    """TIS weighs recomputed old logprobs against the rollout's; with old_logprobs=rollout the two
    are the same numbers and every train step would fail: the config is refused up front."""
    for tis in ("token", "sequence"):
        with pytest.raises(
            ConfigError, match=f"loss.tis={tis} needs learner.old_logprobs=recompute"
        ):
            load_config(None, [f"loss.tis={tis}"])
    cfg = load_config(None, ["loss.tis=token", "learner.old_logprobs=recompute"])
    assert cfg.loss.tis == "token" and cfg.learner.old_logprobs == "recompute"


def test_mis_needs_recomputed_old_logprobs_and_corrects_overlap():
    """MIS compares the same two logprobs as TIS (refused without recompute, for the same reason)
    and, like TIS, is a correction that overlapped rollouts with recomputed old logprobs accept."""
    for mis in ("token", "sequence", "geometric"):
        with pytest.raises(
            ConfigError, match=f"loss.mis={mis} needs learner.old_logprobs=recompute"
        ):
            load_config(None, [f"loss.mis={mis}"])
    recompute = ["learner.old_logprobs=recompute", "train.overlap_rollouts=true"]
    cfg = load_config(None, [*recompute, "loss.mis=geometric", "loss.mis_low=0.8"])
    assert (cfg.loss.mis, cfg.loss.mis_low, cfg.loss.mis_high) == ("geometric", 0.8, 2.0)
    with pytest.raises(ConfigError, match="mis_high"):
        load_config(None, [*recompute, "loss.mis=token", "loss.mis_high=0.5"])


@pytest.mark.parametrize("old", ["rollout", "recompute"])
@pytest.mark.parametrize(
    "stale", ["train.max_staleness=1", "train.overlap_rollouts=true", "train.max_staleness=3"]
)
def test_stale_samples_need_an_importance_correction_whatever_old_logprobs_is(old, stale):
    with pytest.raises(
        ConfigError, match=r"train.max_staleness=\d trains on samples .* set loss.tis"
    ):
        load_config(None, [stale, f"learner.old_logprobs={old}"])
    for fix in ("loss.tis=token", "loss.mis=sequence"):
        cfg = load_config(None, [stale, "learner.old_logprobs=recompute", fix])
        assert cfg.train.max_staleness >= 1
    assert load_config(None, [f"learner.old_logprobs={old}"]).train.max_staleness == 0


def test_text_settings_take_the_override_as_written():
    cfg = load_config(
        None,
        [
            "output_dir=2024",
            "log.wandb_name=1",
            "eval.split=1",
            "log.wandb_entity=run #1",
            'log.wandb_project="2024"',
            "model.path=2024-01-01",
        ],
    )
    assert (cfg.output_dir, cfg.log.wandb_name, cfg.eval.split) == ("2024", "1", "1")
    assert (cfg.log.wandb_entity, cfg.log.wandb_project, cfg.model.path) == (
        "run #1",
        "2024",
        "2024-01-01",
    )
    assert load_config(None, ["log.wandb_name=1", "log.wandb_name=null"]).log.wandb_name is None
    # Typed and free-form settings still read YAML.
    cfg = load_config(
        None,
        [
            "train.steps=3",
            "learner.row_tokens=512",
            "learner.lora.target_modules=[q_proj]",
            "env.kwargs.n=2024",
            "rollout.temperature=0.5",
            "train.save_every_s=null",
            "engine.kind=sglang",
            "engine.sglang.urls=[http://h:1]",
        ],
    )
    assert (cfg.train.steps, cfg.learner.row_tokens, cfg.learner.lora.target_modules) == (
        3,
        512,
        ["q_proj"],
    )
    assert (
        cfg.env.kwargs == {"n": 2024}
        and cfg.rollout.temperature == 0.5
        and cfg.train.save_every_s is None
    )
    assert cfg.engine.sglang.urls == ["http://h:1"]


def test_unreadable_config_files_and_bad_yaml_are_clean_errors(tmp_path, capsys):
    from agentgrpo.cli import main

    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"cannot read the config file {missing}"):
        load_config(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1\n")
    with pytest.raises(ConfigError, match=f"{bad} is not valid YAML: .*line 3"):
        load_config(bad)
    with pytest.raises(
        ConfigError, match=r"override 'eval.pass_k=\[1': the value is not valid YAML"
    ):
        load_config(None, ["eval.pass_k=[1"])
    for argv in (["train", str(missing)], ["eval", str(bad)]):
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith("error: ")


def test_deterministic_decodes_one_at_a_time_and_refuses_what_timing_decides():
    cfg = load_config(None, ["deterministic=true"])
    assert (cfg.engine.max_batch_size, cfg.engine.prefix_cache_tokens) == (1, 0)
    again = load_config(None, ["deterministic=true", "engine.max_batch_size=1"])  # as dumped
    assert again.engine == cfg.engine
    assert load_config(None, []).engine.max_batch_size > 1  # untouched without it
    with pytest.raises(ConfigError, match="engine.max_batch_size is 4; leave it unset or set 1"):
        load_config(None, ["deterministic=true", "engine.max_batch_size=4"])
    with pytest.raises(ConfigError, match="engine.prefix_cache_tokens is 64"):
        load_config(None, ["deterministic=true", "engine.prefix_cache_tokens=64"])
    stale = ["learner.old_logprobs=recompute", "loss.tis=token"]
    load_config(None, ["deterministic=true", "train.max_staleness=1", *stale])  # one step: exact
    for timed, match in [
        (["train.max_staleness=2", *stale], "train.max_staleness=2"),
        (["engine.partial_rollouts=true"], "engine.partial_rollouts"),
        (
            ["train.max_staleness=1", *stale, "shaping.dynamic_sampling=true"],
            "shaping.dynamic_sampling with train.max_staleness=1",
        ),
        (["engine.kind=sglang", "engine.sglang.urls=[http://127.0.0.1:1]"], "engine.kind=sglang"),
        (["engine.kind=vllm", "engine.vllm.urls=[http://127.0.0.1:1]"], "engine.kind=vllm"),
    ]:
        with pytest.raises(ConfigError, match=f"deterministic: true cannot hold with {match}"):
            load_config(None, ["deterministic=true", *timed])
