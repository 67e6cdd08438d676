"""Many processes on CPU (gloo): the whole loop under 2 ranks equals 1 process, resume included; the
learner under FSDP (sharded parameters) trains, checkpoints and exports like 1 process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from agentgrpo.algo.loss import LossConfig
from agentgrpo.learner.learner import Learner, LearnerConfig
from agentgrpo.run.log import read_jsonl
from tests.ranks import free_port, spawn_gloo
from tests.short_runs import by_step, train, weights
from tests.test_learner import TEMPERATURE, assert_trained_alike, batch_and_advantages
from tests.tiny import rows, tiny_llama

CFG = LearnerConfig(lr=1e-2, micro_batch_tokens=64, grad_clip=1e9, warmup_steps=2)
LOSS = LossConfig(kl_coef=0.1)
SHARDED = CFG.model_copy(update={"checkpoint_format": "sharded"})
HANG = (
    "learner.collective_timeout_s=120"  # a rank left waiting fails the test instead of hanging it
)


# --- the whole loop -------------------------------------------------------------------------------


def _train_on_rank(rank: int, out: str, model_dir: str, steps: int, *extra: str) -> None:
    worlds, close = [], Learner.close

    def recording_close(self):
        worlds.append(torch.distributed.get_world_size())
        close(self)

    Learner.close = recording_close  # this process's own copy of the class
    assert train(out, model_dir, steps, "train.save_every=2", HANG, *extra) == 0
    assert worlds == [2]  # the ranks really trained together, and the group was closed


def test_two_ranks_run_the_loop_like_one_process_and_resume(tmp_path, stopping_model_dir):
    one, two = tmp_path / "one", tmp_path / "two"
    assert train(one, stopping_model_dir, 3, "train.save_every=2") == 0
    spawn_gloo(_train_on_rank, str(two), str(stopping_model_dir), 2)
    # Rank 0 alone logged: one row per step, no second copy from rank 1.
    assert [m["step"] for m in read_jsonl(two / "metrics.jsonl")] == [1, 2]
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step-000002"]
    spawn_gloo(
        _train_on_rank, str(two), str(stopping_model_dir), 3
    )  # both ranks resume from step 2
    assert [m["step"] for m in read_jsonl(two / "metrics.jsonl")] == [1, 2, 3]

    a, b = by_step(one), by_step(two)
    assert a == b  # same tasks, sampled tokens and rewards in every step
    assert len({r for s in a.values() for (_, _, r) in s}) > 1  # rewards vary: the weights train
    from safetensors.torch import load_file

    w0 = load_file(stopping_model_dir / "model.safetensors")
    w1, w2 = weights(one, 3), weights(two, 3)
    # Two ranks sum the gradient in another order, and Adam magnifies tiny differences on weights
    # whose gradient is ~0 (g / (|g| + eps)): measured ~0.1% of how far each tensor moved.
    for name, t in w1.items():
        moved, apart = float((t - w0[name]).norm()), float((w2[name] - t).norm())
        assert moved > 1e-3 and apart <= 0.01 * moved + 1e-6, (name, moved, apart)
    m1, m2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [m["loss"] for m in m2] == pytest.approx([m["loss"] for m in m1], abs=1e-6)


def test_a_launch_accelerate_would_run_as_one_process_is_refused(monkeypatch):
    from accelerate import Accelerator

    monkeypatch.setenv("WORLD_SIZE", "2")  # e.g. a GPU-less torchrun without --cpu
    with pytest.raises(ValueError, match="WORLD_SIZE=2 but accelerate runs 1 process"):
        Learner(tiny_llama(), CFG, LOSS, accelerator=Accelerator())


def test_two_ranks_resume_from_sharded_checkpoints(tmp_path, stopping_model_dir):
    one, two = tmp_path / "one", tmp_path / "two"
    assert train(one, stopping_model_dir, 3, "train.save_every=2") == 0
    for steps in (2, 3):  # the second run resumes from the shards both ranks wrote at step 2
        spawn_gloo(
            _train_on_rank,
            str(two),
            str(stopping_model_dir),
            steps,
            "learner.checkpoint_format=sharded",
        )
    assert [m["step"] for m in read_jsonl(two / "metrics.jsonl")] == [1, 2, 3]
    assert list((two / "checkpoints" / "step-000003" / "dcp").glob("*.distcp"))
    assert by_step(one) == by_step(two)  # step 3 sampled the same tokens: the weights came back


def _stopped_on_rank_1(rank: int, out: str, model_dir: str) -> None:
    import signal

    if rank == 1:  # SIGTERM reaches one rank only, in step 1 of 4
        step = Learner.train_step

        def signalled(self, *a, **kw):
            if self.step == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            return step(self, *a, **kw)

        Learner.train_step = signalled
    assert train(out, model_dir, 4, HANG) == 0


def test_a_stop_signal_on_one_rank_stops_every_rank_after_a_checkpoint(
    tmp_path, stopping_model_dir
):
    out = tmp_path / "run"
    spawn_gloo(_stopped_on_rank_1, str(out), str(stopping_model_dir))
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]


# --- FSDP -----------------------------------------------------------------------------------------


def _fsdp_accelerator(launch_env: dict[str, str] | None = None):
    """accelerate chooses FSDP only on accelerators (CUDA, XPU, ...). On CPU the test sets the
    state by hand, so that accelerate's own FSDP2 preparation (`fully_shard` per decoder layer,
    DTensor parameters) runs over gloo exactly as it would over NCCL. The plugin is built by hand,
    or from the environment `accelerate launch` gives a rank (`_launch_env`)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True)
    acc.state.distributed_type = DistributedType.FSDP
    if launch_env is None:
        acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
    else:
        os.environ.update(launch_env)  # this rank's own process
        acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    return acc


def test_fsdp1_is_refused_with_the_setting_that_selects_fsdp2(monkeypatch):
    """accelerate's default `fsdp_version` is 1; the learner is FSDP2 code (and FSDP1 refuses a CPU
    device, so it could not even be tested here)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True)  # one process: the refusal comes before any collective
    # The state is shared by every Accelerator of this process: monkeypatch puts it back.
    monkeypatch.setattr(acc.state, "distributed_type", DistributedType.FSDP)
    monkeypatch.setattr(
        acc.state, "fsdp_plugin", FullyShardedDataParallelPlugin(fsdp_version=1), raising=False
    )
    with pytest.raises(ValueError, match="FSDP version 1: .*`fsdp_version: 2`.*FSDP_VERSION=2"):
        Learner(tiny_llama(), CFG, LOSS, accelerator=acc)


ACCELERATE_FSDP2 = Path(__file__).parents[1] / "examples" / "gpu" / "accelerate_fsdp2.yml"


def _launch_env(config_file: Path) -> dict[str, str]:
    """The FSDP settings `accelerate launch --config_file config_file` hands every rank, computed by
    accelerate's own launcher code (which reads the file)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(config_file), "-m", "agentgrpo.cli"]
    )
    args, _, _ = _validate_launch_command(args)
    return {
        k: v
        for k, v in prepare_multi_gpu_env(args).items()
        if k.startswith(("FSDP_", "ACCELERATE_"))
    }


def test_the_fsdp2_accelerate_config_file_launches_fsdp2(monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    cfg = load_config_from_file(str(ACCELERATE_FSDP2))  # raises on an unknown top-level key
    assert cfg.distributed_type == DistributedType.FSDP and cfg.fsdp_config["fsdp_version"] == 2
    # accelerate launch copies fsdp_config keys onto its options without checking them: a misspelt
    # key would be dropped silently.
    options = vars(launch_command_parser().parse_args(["x.py"]))
    assert [k for k in cfg.fsdp_config if k not in options] == []
    env = _launch_env(ACCELERATE_FSDP2)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "no"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    plugin = FullyShardedDataParallelPlugin()  # what each launched rank's Accelerator builds
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert (
        plugin.auto_wrap_policy is transformer_auto_wrap_policy and plugin.cpu_ram_efficient_loading
    )


def _steps(learner: Learner, n: int, seed: int = 0) -> dict[str, list[float]]:
    """`n` steps on the same batch; their losses and gradient norms. The norm is the sharper witness
    of ranks that reduce wrongly: torch 2.7/2.8's gloo reduce-scatter summed where FSDP2 asked for
    the mean (pytorch/pytorch#162338), doubling the gradients it reduced on 2 CPU ranks (a first
    norm of 1.06 for 0.70 here), which Adam all but hides from the loss and the weights."""
    data = batch_and_advantages(seed=seed) if learner.is_main else None
    trajs, adv = learner.broadcast(data)
    steps = [learner.train_step(rows(trajs, adv)) for _ in range(n)]
    return {k: [m[k] for m in steps] for k in ("loss", "grad_norm")}


def _assert_steps_alike(
    got: dict[str, list[float]], want: dict[str, list[float]], what: str, **loss_tolerance: float
) -> None:
    assert got["loss"] == pytest.approx(want["loss"], **loss_tolerance), what
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), what


def _fsdp_rank(rank: int, tmp: str) -> None:
    from torch.distributed.tensor import DTensor

    tmp_path = Path(tmp)
    learner = Learner(
        tiny_llama(), CFG, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator()
    )
    assert learner.sharded and all(isinstance(p, DTensor) for p in learner.model.parameters())
    assert all(isinstance(p, DTensor) for p in learner.ref.parameters())  # the KL reference too
    _steps(learner, 2)
    learner.save(tmp_path / "fsdp-ckpt")  # rank 0 writes the gathered state
    exported = learner.export_model()  # gathered into rank 0's plain copy
    assert (exported is None) == (rank != 0)
    if rank == 0:
        torch.save(exported.state_dict(), tmp_path / "fsdp-2steps.pt")

    resumed = Learner(
        tiny_llama(), CFG, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator()
    )
    resumed.load(tmp_path / "one-ckpt")  # written by 1 process, loaded into shards
    _steps(resumed, 1, seed=1)
    exported = resumed.export_model()
    if rank == 0:
        torch.save(exported.state_dict(), tmp_path / "fsdp-resumed.pt")


def _assert_close(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), what
    for name, t in b.items():
        torch.testing.assert_close(a[name], t, atol=2e-6, rtol=1e-4, msg=f"{what}: {name}")


def test_fsdp_shards_train_checkpoint_and_export_like_one_process(tmp_path):
    # Every learner starts from the same base model, as a resumed run does from model.path: the
    # KL reference is that base, and the checkpoint holds only what training changed.
    one = Learner(tiny_llama(), CFG, LOSS, temperature=TEMPERATURE)
    _steps(one, 2)
    one.save(tmp_path / "one-ckpt")
    after_two = {k: v.clone() for k, v in one.unwrapped.state_dict().items()}
    _steps(one, 1, seed=1)

    spawn_gloo(_fsdp_rank, str(tmp_path))

    _assert_close(torch.load(tmp_path / "fsdp-2steps.pt"), after_two, "2 FSDP ranks, 2 steps")
    # The sharded run's checkpoint holds the full optimizer state: a 1-process learner loads it
    # and continues exactly like the 1-process run.
    loaded = Learner(tiny_llama(), CFG, LOSS, temperature=TEMPERATURE)
    loaded.load(tmp_path / "fsdp-ckpt")
    _steps(loaded, 1, seed=1)
    _assert_close(
        loaded.unwrapped.state_dict(),
        one.unwrapped.state_dict(),
        "FSDP checkpoint, resumed by 1 process",
    )
    # A 1-process checkpoint loaded into FSDP shards continues like the 1-process run too.
    _assert_close(
        torch.load(tmp_path / "fsdp-resumed.pt"),
        one.unwrapped.state_dict(),
        "1-process checkpoint, resumed under FSDP",
    )


def _tied_llama():
    """tiny_llama with lm_head tied to the input embeddings, as in SmolLM2 or Qwen2.5 up to 3B."""
    from transformers import LlamaForCausalLM

    config = tiny_llama().config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _weightless(build, directory: str):
    """What `agentgrpo train` loads on a rank other than 0 under RAM-efficient loading
    (`models.load_policy`): the model built from its config alone (config.json is all there is to
    read), parameters on the meta device, non-persistent buffers (rotary frequencies) computed."""
    from agentgrpo.models.embedded import load_policy

    build().config.save_pretrained(directory)
    model = load_policy(directory)
    assert all(p.is_meta for p in model.parameters())
    return model


def _ram_efficient_rank(rank: int, tmp: str, launch_env: dict[str, str]) -> None:
    from agentgrpo.learner.state import full_weights

    os.environ.update(launch_env)  # what accelerate launch gives each rank (load_policy reads it)
    for build in (tiny_llama, _tied_llama):
        model = build() if rank == 0 else _weightless(build, f"{tmp}/{build.__name__}-config")
        learner = Learner(
            model, CFG, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator(launch_env)
        )
        assert learner.accelerator.state.fsdp_plugin.cpu_ram_efficient_loading
        for module in (learner.model, learner.ref):
            assert not any(p.to_local().is_meta for p in module.parameters()), rank
        ref = full_weights(learner.ref)  # gathered to rank 0 before training
        steps = _steps(learner, 2)
        exported = learner.export_model()
        if rank == 0:
            torch.save(
                {"ref": ref, "steps": steps, "weights": exported.state_dict()},
                f"{tmp}/ram-efficient-{build.__name__}.pt",
            )


def test_ram_efficient_loading_trains_like_one_process_when_only_rank_0_has_weights(tmp_path):
    """With the shipped accelerate config (cpu_ram_efficient_loading on), rank 1's model has no
    weights: the policy and the KL reference get rank 0's, and 2 steps equal 1 process, with and
    without tied embeddings (accelerate moves the policy to meta, which unties them)."""
    spawn_gloo(_ram_efficient_rank, str(tmp_path), _launch_env(ACCELERATE_FSDP2))
    for build in (tiny_llama, _tied_llama):
        one = Learner(build(), CFG, LOSS, temperature=TEMPERATURE)
        start = {k: v.clone() for k, v in one.unwrapped.state_dict().items()}
        base = {f"model.{k}": v for k, v in start.items()}
        steps = _steps(one, 2)
        got = torch.load(tmp_path / f"ram-efficient-{build.__name__}.pt")
        _assert_close(got["ref"], base, f"{build.__name__}: the KL reference, filled from rank 0")
        _assert_steps_alike(got["steps"], steps, build.__name__, abs=1e-6)
        assert_trained_alike(
            got["weights"],
            one.unwrapped.state_dict(),
            start,
            f"{build.__name__}: weights on rank 0 only",
        )


def test_the_documented_torchrun_command_runs_two_ranks(tmp_path, tiny_model_dir):
    """`torchrun --nproc_per_node 2 -m agentgrpo.cli train ...`, the README's CPU command
    (`accelerate launch --cpu` starts one process unless given an MPI hostfile)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "agentgrpo.cli",
        "train",
        "examples/calculator.yaml",
        f"output_dir={out}",
        "train.steps=1",
        f"model.path={tiny_model_dir}",
        "rollout.group_size=2",
        "rollout.tasks_per_step=2",
        "rollout.max_new_tokens=8",
        "rollout.max_tokens=32",
        "log.progress=false",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "processes: 2 (MULTI_CPU)" in proc.stdout
    assert proc.stdout.count("run directory:") == 1  # rank 0 alone reports
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1]


LORA = LearnerConfig(lr=1e-2, micro_batch_tokens=64, grad_clip=1e9, lora={"r": 4, "alpha": 8})


def _ddp_lora_rank(rank: int, tmp: str) -> None:
    from accelerate import Accelerator

    learner = Learner(
        tiny_llama(), LORA, LOSS, temperature=TEMPERATURE, accelerator=Accelerator(cpu=True)
    )
    _steps(learner, 2)
    if rank == 0:
        torch.save(learner.export_state_dict(), f"{tmp}/lora-ddp.pt")


def _fsdp_lora_rank(rank: int, tmp: str) -> None:
    learner = Learner(
        tiny_llama(), LORA, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator()
    )
    _steps(learner, 2)
    if rank == 0:  # a slow disk: rank 1 must not read the checkpoint before rank 0 has written it
        write = learner.unwrapped.save_pretrained
        learner.unwrapped.save_pretrained = lambda *a, **kw: (time.sleep(1.0), write(*a, **kw))
    learner.save(Path(tmp) / "lora-ckpt")
    resumed = Learner(
        tiny_llama(), LORA, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator()
    )
    resumed.load(Path(tmp) / "lora-ckpt")
    for name, exported in (
        ("trained", learner.export_model()),
        ("resumed", resumed.export_model()),
    ):
        if rank == 0:
            torch.save(exported.state_dict(), Path(tmp) / f"lora-{name}.pt")


def test_lora_under_ddp_and_fsdp_exports_merged_weights_and_resumes_like_one_process(tmp_path):
    one = Learner(tiny_llama(), LORA, LOSS, temperature=TEMPERATURE)
    _steps(one, 2)
    spawn_gloo(_ddp_lora_rank, str(tmp_path))
    spawn_gloo(_fsdp_lora_rank, str(tmp_path))
    merged = one.export_state_dict()
    _assert_close(torch.load(tmp_path / "lora-ddp.pt"), merged, "LoRA under DDP, merged export")
    _assert_close(
        torch.load(tmp_path / "lora-trained.pt"), merged, "LoRA under FSDP, merged export"
    )
    _assert_close(
        torch.load(tmp_path / "lora-resumed.pt"),
        merged,
        "LoRA adapter checkpoint, resumed under FSDP",
    )


def _fsdp_sharded_rank(rank: int, tmp: str) -> None:
    learner = Learner(
        tiny_llama(), SHARDED, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator()
    )
    _steps(learner, 2)
    learner.save(Path(tmp) / "sharded")  # every rank writes its own shards
    assert len(list((Path(tmp) / "sharded" / "dcp").glob("*.distcp"))) == 2
    resumed = Learner(
        tiny_llama(), SHARDED, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator()
    )
    resumed.load(Path(tmp) / "sharded")
    _steps(resumed, 1, seed=1)
    exported = resumed.export_model()
    if rank == 0:
        torch.save(exported.state_dict(), Path(tmp) / "sharded-resumed.pt")


def test_sharded_checkpoints_resume_on_two_fsdp_ranks_and_reshard_to_one_process(tmp_path):
    one = Learner(tiny_llama(), SHARDED, LOSS, temperature=TEMPERATURE)
    _steps(one, 2)
    _steps(one, 1, seed=1)
    spawn_gloo(_fsdp_sharded_rank, str(tmp_path))
    _assert_close(
        torch.load(tmp_path / "sharded-resumed.pt"),
        one.unwrapped.state_dict(),
        "2 FSDP ranks resumed from their own shards",
    )
    single = Learner(tiny_llama(), SHARDED, LOSS, temperature=TEMPERATURE)
    single.load(tmp_path / "sharded")  # written by 2 ranks, read by 1: DCP reshards
    assert single.step == 2
    _steps(single, 1, seed=1)
    _assert_close(
        single.unwrapped.state_dict(),
        one.unwrapped.state_dict(),
        "1 process resumed from 2 ranks' shards",
    )


def _chunked_head_rank(rank: int, tmp: str) -> None:
    cfg = CFG.model_copy(update={"head_chunk_tokens": 5})
    learner = Learner(
        _tied_llama(), cfg, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator()
    )
    steps = _steps(learner, 2)
    exported = learner.export_model()
    if rank == 0:
        torch.save({"steps": steps, "weights": exported.state_dict()}, f"{tmp}/chunked.pt")


def test_a_chunked_head_under_fsdp_trains_like_one_process_without_chunks(tmp_path):
    # The head is recomputed per chunk in backward (activation checkpointing) while FSDP2 holds the
    # root's parameters; tied to the embeddings, its gradient sums over the chunks and the input
    # side.
    start = _tied_llama().state_dict()
    one = Learner(_tied_llama(), CFG, LOSS, temperature=TEMPERATURE)
    steps = _steps(one, 2)
    spawn_gloo(_chunked_head_rank, str(tmp_path))
    got = torch.load(tmp_path / "chunked.pt")
    _assert_steps_alike(got["steps"], steps, "FSDP, chunked head", rel=1e-5)
    assert_trained_alike(got["weights"], one.unwrapped.state_dict(), start, "FSDP, chunked head")


CLIPPED = CFG.model_copy(update={"grad_clip": 0.1})  # below every step's norm (0.3 to 0.8 here)


def _record_clipped_norms(learner: Learner) -> list[float]:
    """The norm of the whole model's gradient as each optimizer step gets it (after clipping); under
    FSDP every shard is gathered for it, on every rank alike."""
    seen, step = [], learner.optimizer.step

    def recording_step(*args, **kwargs):
        grads = [p.grad for p in learner.model.parameters() if p.grad is not None]
        full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
        seen.append(float(torch.nn.utils.get_total_norm(full)))
        return step(*args, **kwargs)

    learner.optimizer.step = recording_step
    return seen


def _clipped_rank(rank: int, tmp: str) -> None:
    learner = Learner(
        tiny_llama(), CLIPPED, LOSS, temperature=TEMPERATURE, accelerator=_fsdp_accelerator()
    )
    clipped = _record_clipped_norms(learner)
    steps = _steps(learner, 3)
    exported = learner.export_model()
    if rank == 0:
        torch.save(
            {"steps": steps, "clipped": clipped, "weights": exported.state_dict()},
            f"{tmp}/clipped.pt",
        )


def test_fsdp_clips_by_the_whole_models_norm_like_one_process(tmp_path):
    """Every rank scales its shards by grad_clip over the norm of the whole model, not of its own
    shards (Adam all but hides a wrong scale from the weights, so the clipped gradient itself is
    measured), and the norm logged is the whole model's (torch 2.9 returns it partial over the
    shards: `learner_dist.total_norm`)."""
    start = tiny_llama().state_dict()
    one = Learner(tiny_llama(), CLIPPED, LOSS, temperature=TEMPERATURE)
    clipped = _record_clipped_norms(one)
    steps = _steps(one, 3)
    assert min(steps["grad_norm"]) > 2 * CLIPPED.grad_clip  # the clip acted on every step
    assert clipped == pytest.approx([CLIPPED.grad_clip] * 3, rel=1e-5)
    spawn_gloo(_clipped_rank, str(tmp_path))
    got = torch.load(tmp_path / "clipped.pt")
    assert got["clipped"] == pytest.approx(clipped, rel=1e-5)
    _assert_steps_alike(got["steps"], steps, "FSDP, clipped", abs=1e-6)
    assert_trained_alike(got["weights"], one.unwrapped.state_dict(), start, "FSDP, clipped")
