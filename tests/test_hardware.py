"""agentgrpo.models.hardware: the precision `auto` picks, with the CPU's features and CUDA mocked
so that both answers run on every CPU; and the OpenMP environment and thread count the CLI sets."""

from __future__ import annotations

import pytest
import torch

from agentgrpo.models import hardware
from agentgrpo.models.hardware import (
    FORCE_ENV,
    choose_bf16,
    cpu_native_bf16,
    cpu_threads,
    engine_dtype,
)


def cpu_kind(monkeypatch, capability: str, *, amx: bool, avx512_bf16: bool) -> None:
    """Make this CPU look like another: its capability string and bf16 features."""
    monkeypatch.delenv(FORCE_ENV, raising=False)  # the suite pins it (conftest); read the flags
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


def test_auto_is_fp32_on_an_avx2_cpu(monkeypatch):
    cpu_kind(monkeypatch, "AVX2", amx=False, avx512_bf16=False)
    choice = choose_bf16("auto", "cpu")
    assert not choice.bf16
    assert "AVX2" in choice.reason and "emulated" in choice.reason
    # bf16 learner weights: still an fp32 engine, where bf16 would be emulated
    assert engine_dtype("auto", "cpu", "bfloat16") == (torch.float32, choice.reason)


def test_auto_is_fp32_on_avx512_without_bf16(monkeypatch):
    # "AVX512" is also what a Sapphire Rapids reports: the capability string alone cannot decide.
    cpu_kind(monkeypatch, "AVX512", amx=False, avx512_bf16=False)
    assert not choose_bf16("auto", torch.device("cpu")).bf16


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "named"),
    [(True, True, "AMX and AVX512-BF16"), (False, True, "AVX512-BF16"), (True, False, "AMX")],
)
def test_auto_is_bf16_on_a_cpu_with_native_bf16(monkeypatch, amx, avx512_bf16, named):
    cpu_kind(monkeypatch, "AVX512", amx=amx, avx512_bf16=avx512_bf16)
    choice = choose_bf16("auto", "cpu")
    assert choice.bf16 and choice.reason == f"auto: CPU (AVX512) with native bf16: {named}"
    assert engine_dtype("auto", "cpu", "bfloat16")[0] == torch.bfloat16
    # fp32 learner weights: an fp32 engine (a bf16 one fails the weight sync's probe)
    assert engine_dtype("auto", "cpu", "float32") == (
        torch.float32,
        "auto: the learner's weights are float32",
    )


def test_auto_is_bf16_on_cuda_whatever_the_cpu(monkeypatch):
    cpu_kind(monkeypatch, "AVX2", amx=False, avx512_bf16=False)
    cuda = hardware.Precision(True, "auto: CUDA computes bf16 natively")
    assert choose_bf16("auto", "cuda:0") == cuda
    assert choose_bf16("auto", torch.device("cuda", 1)).bf16
    assert engine_dtype("auto", "cuda", "bfloat16")[0] == torch.bfloat16
    assert engine_dtype("auto", "cuda")[0] == torch.float32  # the learner's default fp32 weights
    assert not choose_bf16("auto", "mps").bf16  # neither CUDA nor a CPU: fp32


def test_explicit_settings_win_over_the_hardware(monkeypatch):
    cpu_kind(monkeypatch, "AVX2", amx=False, avx512_bf16=False)
    assert choose_bf16("bf16", "cpu").bf16  # asked for: taken, even where it is slow
    cpu_kind(monkeypatch, "AVX512", amx=True, avx512_bf16=True)
    assert not choose_bf16("none", "cpu").bf16
    assert not choose_bf16("none", "cuda").bf16
    assert engine_dtype("float32", "cuda") == (torch.float32, "set in the config")
    assert engine_dtype(torch.bfloat16, "cpu")[0] == torch.bfloat16
    with pytest.raises(ValueError, match="'fp16'"):
        choose_bf16("fp16", "cpu")
    with pytest.raises(ValueError, match="not a torch dtype"):
        engine_dtype("bf16", "cpu")


def test_the_environment_override_answers_for_the_cpu(monkeypatch):
    cpu_kind(monkeypatch, "AVX512", amx=True, avx512_bf16=True)
    monkeypatch.setenv(FORCE_ENV, "0")
    assert cpu_native_bf16() == (False, f"{FORCE_ENV}=0 in the environment")
    cpu_kind(monkeypatch, "AVX2", amx=False, avx512_bf16=False)
    monkeypatch.setenv(FORCE_ENV, "1")
    assert choose_bf16("auto", "cpu").bf16
    monkeypatch.setenv(FORCE_ENV, "yes")
    with pytest.raises(ValueError, match="expected 0"):
        cpu_native_bf16()


def test_learner_and_engine_follow_the_choice(monkeypatch, tiny_model_dir):
    from agentgrpo.algo.loss import LossConfig
    from agentgrpo.engine.local.engine import LocalEngine
    from agentgrpo.learner.learner import Learner, LearnerConfig
    from agentgrpo.models.embedded import load_model

    for native in (False, True):
        cpu_kind(monkeypatch, "AVX512" if native else "AVX2", amx=native, avx512_bf16=native)
        learner = Learner(load_model(tiny_model_dir), LearnerConfig(), LossConfig())
        assert learner.precision.bf16 is native and learner.model.autocast_bf16 is native
        for weights in ("float32", "bfloat16"):
            with LocalEngine(
                tiny_model_dir, eos_token_ids=(), dtype="auto", weights_dtype=weights
            ) as engine:
                bf16 = native and weights == "bfloat16"
                assert next(engine.model.parameters()).dtype == (
                    torch.bfloat16 if bf16 else torch.float32
                )
                assert ("native bf16" in engine.dtype_reason) is bf16


def test_thread_env_is_set_only_where_the_user_set_nothing():
    env: dict[str, str] = {}
    assert hardware.set_cpu_thread_env(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert hardware.set_cpu_thread_env(env) == {} and env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"GOMP_SPINCOUNT": "1000"}  # the user tuned the spinning: no policy on top of it
    assert hardware.set_cpu_thread_env(env) == {} and env == {"GOMP_SPINCOUNT": "1000"}


def test_cli_sets_the_thread_env_before_torch_loads():
    import subprocess
    import sys

    # A fresh interpreter whose import system notes OMP_WAIT_POLICY when torch is first imported:
    # the CLI's main must have set it by then (libgomp reads it once, as torch loads).
    code = """
import os, sys
os.environ.pop("OMP_WAIT_POLICY", None); os.environ.pop("GOMP_SPINCOUNT", None)
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
sys.meta_path.insert(0, Spy())
from agentgrpo import cli
assert not seen, "importing the CLI loaded torch"
try:
    cli.main(["train", "--help"])
except SystemExit:
    pass
import torch
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "['PASSIVE']"


def test_thread_count_is_capped_by_affinity_quota_and_local_ranks(monkeypatch, tmp_path):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)  # torch's default: physical cores
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(hardware, "cgroup_cpu_quota", lambda: None)
    assert cpu_threads({}) == 4  # taskset / cpuset: 4 CPUs of 8
    assert cpu_threads({"LOCAL_WORLD_SIZE": "2"}) == 2  # two ranks on this machine share them
    assert cpu_threads({"LOCAL_WORLD_SIZE": "8"}) == 1
    assert cpu_threads({"OMP_NUM_THREADS": "3"}) is None  # the user's choice, torch follows it
    monkeypatch.setattr(hardware, "cgroup_cpu_quota", lambda: 1.5)
    assert cpu_threads({}) == 2  # a container's --cpus=1.5: 2 threads, not 4


def test_cgroup_quota_is_read_from_cpu_max(tmp_path):
    path = tmp_path / "cpu.max"
    path.write_text("150000 100000\n")
    assert hardware.cgroup_cpu_quota(path) == 1.5
    path.write_text("max 100000\n")
    assert hardware.cgroup_cpu_quota(path) is None
    assert hardware.cgroup_cpu_quota(tmp_path / "absent") is None


def test_sampling_beside_training_shares_the_cpu_threads():
    from agentgrpo.models.hardware import share_cpu

    assert share_cpu(2) == (1, 1)
    assert share_cpu(8) == (4, 4)
    assert share_cpu(7) == (3, 4)
    assert share_cpu(1) == (1, 1)  # one CPU: both take turns on it


def test_the_local_engine_sets_threads_in_its_own_thread_only(tiny_model_dir):
    import asyncio

    import torch

    from agentgrpo.engine import LocalEngine, SamplingParams

    before = torch.get_num_threads()
    seen = []  # a count unlike the process's, so the test sees whose setting the worker runs with
    with LocalEngine(tiny_model_dir, threads=before + 1, eos_token_ids=()) as engine:
        real = engine.model.forward

        def forward(*a, **kw):
            seen.append(torch.get_num_threads())
            return real(*a, **kw)

        engine.model.forward = forward
        asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2)))
    assert seen and set(seen) == {before + 1}
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("cuda", [False, True])
def test_deterministic_mode_is_torchs_and_warns_only_on_cuda(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        line = hardware.make_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() == cuda
        # cuBLAS needs a fixed workspace for deterministic matmuls; the CPU nothing of the kind
        assert ("CUBLAS_WORKSPACE_CONFIG" in hardware.os.environ) == cuda
        assert line.startswith("deterministic algorithms")
    finally:  # process-wide: the rest of the suite runs without it
        torch.use_deterministic_algorithms(False)
        hardware.os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
