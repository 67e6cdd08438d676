"""The GPU benchmark runs once per GPU session, which is rare and short: its script must not be the
thing that fails there. A smoke test of bench/learner_gpu.py on a tiny config on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_gpu_benchmark_script_runs_and_writes_its_ratios(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "bench/learner_gpu.py", "--tiny", "--device", "cpu", "--repeats", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "learner_gpu.json").read_text())
    ratios = {
        k: v for batch in ("spread", "grpo", "long") for k, v in results[batch]["ratios"].items()
    }
    assert {
        "learner/bare",
        "packed speed-up over padded",
        "shared_prefix speed-up over packed",
        "head chunks time",
        "row_tokens auto speed-up over whole groups",
    } <= set(ratios)
    assert all(math.isfinite(v) and v > 0 for k, v in ratios.items() if "memory" not in k)
