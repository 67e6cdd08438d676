import pytest

from agentgrpo.config import ConfigError, dump_config, load_config


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
    from agentgrpo.log import mask_secrets

    assert mask_secrets({"a": {"api_key": "sk-1", "n": 1}, "token": "t"}) == {"a": {"api_key": "***", "n": 1}, "token": "***"}
    assert mask_secrets({"HF-Token": "hf_x", "apiKey": "k", "row_tokens": "auto"}) == {
        "HF-Token": "***", "apiKey": "***", "row_tokens": "auto"}
    assert "***" not in dump_config(load_config(None))


def test_more_mini_batches_than_groups_per_step_is_refused():
    with pytest.raises(ConfigError, match="learner.mini_batches=8"):
        load_config("examples/calculator.yaml", ["learner.mini_batches=8", "rollout.tasks_per_step=4"])
    assert load_config("examples/calculator.yaml", ["learner.mini_batches=4"]).learner.mini_batches == 4


def test_a_row_cap_without_shared_prefix_is_refused():
    with pytest.raises(ConfigError, match="row_tokens=512 caps shared-prefix rows"):
        load_config("examples/calculator.yaml", ["learner.row_tokens=512", "learner.packing=packed"])
    with pytest.raises(ConfigError, match="row_tokens"):
        load_config("examples/calculator.yaml", ["learner.row_tokens=8"])
    assert load_config("examples/calculator.yaml", ["learner.row_tokens=512"]).learner.row_tokens == 512
