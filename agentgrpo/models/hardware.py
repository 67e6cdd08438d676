"""What the machine runs fast: bf16 or fp32 for the learner and the local engine, and CPU threads.

Precision: bf16 only where the hardware computes it natively (CUDA, or a CPU with AVX512-BF16 or
AMX, read from the flags torch reads at start-up, never from a timed probe); emulated bf16 is many
times slower than fp32. Threads: `set_cpu_thread_env` sets `OMP_WAIT_POLICY=PASSIVE` before torch
loads (unless the user set it), so spinning OpenMP threads do not burn a shared machine's CPU, and
the intra-op thread count is one per CPU the process may use. This module never imports the run
level and imports torch only inside its functions, so the CLI can call `set_cpu_thread_env` first.
docs/performance.md ("Precision and threads on the CPU") has the reasons and the numbers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

# OpenMP settings for a CPU that other processes may share (see the module docstring); a key the
# user has set in the environment is left alone, and so is the rest when they set GOMP_SPINCOUNT,
# which libgomp lets override the wait policy's spin count.
THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# Answers `cpu_native_bf16` instead of the CPU's flags when set (0 or 1).
FORCE_ENV = "AGENTGRPO_CPU_BF16"


@dataclass(frozen=True)
class Precision:
    """A precision decision and why it was taken (logged at start-up)."""

    bf16: bool
    reason: str


def cpu_native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), and the features it read.
    `AGENTGRPO_CPU_BF16=0` or `1` in the environment answers instead (the test suite sets 0, so
    that its fp32 tolerances hold on every CPU, in the processes it spawns too)."""
    import torch  # not at the top: see the module docstring

    forced = os.environ.get(FORCE_ENV)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{FORCE_ENV}={forced!r}: expected 0 (no native bf16) or 1")
        return forced == "1", f"{FORCE_ENV}={forced} in the environment"
    amx = bool(torch.cpu._is_amx_tile_supported())
    avx512_bf16 = bool(torch.cpu._is_avx512_bf16_supported())
    capability = torch.backends.cpu.get_cpu_capability()
    found = [name for name, ok in (("AMX", amx), ("AVX512-BF16", avx512_bf16)) if ok]
    if found:
        return True, f"CPU ({capability}) with native bf16: {' and '.join(found)}"
    return False, f"CPU ({capability}) without AVX512-BF16 or AMX: bf16 would be emulated"


def choose_bf16(setting: Literal["auto", "bf16", "none"], device: torch.device | str) -> Precision:
    """bf16 or fp32 for `device`: `bf16` and `none` are taken as given; `auto` is bf16 on CUDA and
    on a CPU with native bf16, fp32 anywhere else."""
    if setting not in ("auto", "bf16", "none"):
        raise ValueError(f"precision setting {setting!r}: expected 'auto', 'bf16' or 'none'")
    if setting != "auto":
        return Precision(setting == "bf16", f"set to {setting} in the config")
    kind = device.type if not isinstance(device, str) else device.split(":")[0]
    if kind == "cuda":
        return Precision(True, "auto: CUDA computes bf16 natively")
    if kind != "cpu":
        return Precision(False, f"auto: fp32 on a {kind} device (bf16 is chosen on CUDA and CPUs)")
    native, why = cpu_native_bf16()
    return Precision(native, f"auto: {why}")


def engine_dtype(
    setting: str | torch.dtype, device: torch.device | str, weights: str = "float32"
) -> tuple[torch.dtype, str]:
    """The local engine's weight dtype and why. `auto` decodes in the dtype of the weights it is
    sent (`weights`, the learner's parameter dtype), except bf16 where the hardware would emulate
    it (fp32 then, as `choose_bf16` decides): bf16 decoding against fp32 weights fails the weight
    sync's probe (its default tolerance; docs/performance.md) and adds that much off-policy noise
    to the importance ratio. Anything else is a torch dtype or its name, used as given."""
    import torch

    if setting == "auto":
        if weights != "bfloat16":
            return torch.float32, f"auto: the learner's weights are {weights}"
        choice = choose_bf16("auto", device)
        return (torch.bfloat16 if choice.bf16 else torch.float32), choice.reason
    dtype = setting if isinstance(setting, torch.dtype) else getattr(torch, str(setting), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"engine dtype {setting!r} is not a torch dtype (auto, float32, bfloat16)")
    return dtype, "set in the config"


def set_cpu_thread_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put `THREAD_ENV` into `environ` (default `os.environ`) where the user set nothing; returns
    what it set. Call it before torch is imported: libgomp reads these once, when it loads."""
    environ = os.environ if environ is None else environ
    if "GOMP_SPINCOUNT" in environ:  # the user tuned the spinning themselves
        return {}
    added = {k: v for k, v in THREAD_ENV.items() if k not in environ}
    environ.update(added)
    return added


def cpu_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """Intra-op threads for torch on the CPU, or None when the user chose with OMP_NUM_THREADS
    (torch already follows it). torch's own default is one per physical core of the machine; this
    caps it at the CPUs this process may run on (taskset, cpusets) and at a cgroup v2 CPU quota
    (a container's `--cpus`), where more threads than CPUs would wait on each other, and shares
    them among the LOCAL_WORLD_SIZE processes of a launch."""
    import torch

    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS"):
        return None
    limits = [torch.get_num_threads()]
    if hasattr(os, "sched_getaffinity"):  # Linux; macOS and Windows have no affinity call
        limits.append(len(os.sched_getaffinity(0)))
    quota = cgroup_cpu_quota()
    if quota is not None:
        limits.append(math.ceil(quota))
    # Processes launched together on this machine (accelerate, torchrun) share its CPUs.
    per_machine = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(limits) // per_machine)


def share_cpu(threads: int) -> tuple[int, int]:
    """(engine, learner) torch threads when the local engine decodes while the learner trains on
    the same CPU (`train.max_staleness` >= 1): `threads` split in two, at least one each. Both at
    full width would put twice as many busy threads as CPUs on the machine, each of the two
    OpenMP teams waiting on members the other one holds (measured in docs/performance.md)."""
    engine = max(1, threads // 2)
    return engine, max(1, threads - engine)


def cgroup_cpu_quota(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """CPUs' worth of time the cgroup v2 quota allows ("200000 100000" = 2.0), None when unlimited
    or unknown."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):  # no cgroup v2 here, or a format this does not know: no limit
        return None
    return None if quota == "max" else int(quota) / int(period)


def configure_cpu_threads() -> str:
    """Set torch's intra-op threads as `cpu_threads` chooses; returns a line for the run's log."""
    import torch

    threads = cpu_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    chosen = "from OMP_NUM_THREADS" if threads is None else "one per CPU available"
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    return f"torch threads {torch.get_num_threads()} ({chosen}), OMP_WAIT_POLICY={policy}"


def make_deterministic() -> str:
    """torch's deterministic algorithms for the whole process (the run's `deterministic` setting);
    returns a line for the run's log. On the CPU the ops whose additions follow the thread timing
    (index_put_ with accumulate, ...) then take an ordered version, and one without any raises; the
    learner's own gathers avoid them already (`learner.attention.take_rows`), so this guards the
    model's code. On CUDA cuBLAS needs a fixed
    workspace (CUBLAS_WORKSPACE_CONFIG, set here when unset, before any cuBLAS handle exists),
    and ops with no deterministic kernel (flash attention's backward among them) warn instead of
    failing: untested on a GPU, so not promised there."""
    import torch

    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        return "deterministic algorithms (CUDA: warn where none exists)"
    torch.use_deterministic_algorithms(True)
    return "deterministic algorithms"
