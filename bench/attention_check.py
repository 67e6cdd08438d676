"""How far right and wrong attention kernels lie from the 4D mask on the probe batches of
`learner.attention: auto`'s start-up check (`Learner._check_attention`), to set its tolerances
(`agentgrpo.learner.attention.CHECK_TOLERANCE`).

Model: the embedded SmolLM2-135M-Instruct (a trained model; on a random one every kernel moves the
logprobs little). For each probe seed and each precision (fp32, bf16 autocast) it prints
`attention_gap` (the mean absolute difference of the loss tokens' logprobs or entropies) of:
  - segments                segment attention, what `auto` picks on the CPU
  - varlen (reference)      varlen attention through tests/varlen_reference.py's CPU kernel
  - varlen (top-left)       the same with flash-attn 2.0's top-left causal alignment: wrong for a
                            continuation of a shared prompt
  - sequences see each other  the packed rows under plain causal attention, no mask

    python bench/attention_check.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentgrpo.learner import attention  # noqa: E402
from agentgrpo.learner.batch import make_micro_batches  # noqa: E402
from agentgrpo.learner.logprobs import PolicyForward, attention_gap  # noqa: E402
from agentgrpo.models.embedded import default_model_path  # noqa: E402
from tests.varlen_reference import reference_varlen_attn, top_left_varlen_attn  # noqa: E402


def leak_gap(forward: PolicyForward, batch) -> float:
    """`attention_gap` of the packed rows run as plain causal rows (each sequence sees the ones
    before it in its row) against the 4D mask."""
    with torch.no_grad():
        lp_ref, ent_ref = forward(batch, 0.7, layout="mask")
        batch.needs_mask = False
        lp, ent = forward(batch, 0.7)
        batch.needs_mask = True
    return float(torch.maximum((lp - lp_ref).abs().mean(), (ent - ent_ref).abs().mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    base = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    # the reference kernels take every keyword torch >= 2.11's varlen_attn takes
    attention._kernel_params = lambda kernel: frozenset({"window_size", "scale", "enable_gqa"})
    print(f"tolerances: { ({str(k): v for k, v in attention.CHECK_TOLERANCE.items()}) }")
    for seed in range(args.seeds):
        rows = attention.probe_rows(base.config.vocab_size, seed=seed)
        (probe,) = make_micro_batches(rows, 4096, mode="shared_prefix")
        for bf16 in (False, True):
            gaps = {}
            for name, kernel in (
                ("segments", None),
                ("varlen (reference)", reference_varlen_attn),
                ("varlen (top-left)", top_left_varlen_attn),
            ):
                model = copy.deepcopy(base)
                if kernel is None:
                    attention.use_segments(model)
                else:
                    attention.VARLEN_KERNEL = kernel
                    attention.use_varlen(model)
                gaps[name] = attention_gap(PolicyForward(model, autocast_bf16=bf16), probe, 0.7)
            plain = PolicyForward(copy.deepcopy(base), autocast_bf16=bf16)
            gaps["sequences see each other"] = leak_gap(plain, probe)
            line = ", ".join(f"{k} {v:.2g}" for k, v in gaps.items())
            print(f"probe {seed}, {'bf16 autocast' if bf16 else 'fp32'}: {line}", flush=True)


if __name__ == "__main__":
    main()
