"""GPU benchmark of the learner step (H200): tokens/s, MFU, packed vs padded, shared prompts, peak
memory; every number a ratio against a baseline measured in the same run.

Model: a random-initialised Qwen2-style network of ~0.5B parameters (Qwen2.5-0.5B's shape: hidden
896, 24 layers, 14 heads / 2 KV, MLP 4864, vocab 151936, tied embeddings), so nothing is downloaded.
fp32 master weights with bf16 autocast and the LM head's fp32 matmuls on TF32 (the learner's
defaults on CUDA), sdpa attention. Variants whose name says no other attention run packed rows under
the 4D mask (`learner.attention: mask`, what `auto` ran on CUDA before varlen); those named varlen
run torch's variable-length flash attention (`attention: varlen`, what `auto` picks on CUDA with
torch >= 2.10). `--attn flash_attention_2` uses flash-attn's own varlen packing where installed.

Variants, each timed over interleaved repeats after a warm-up step:
  - learner, packed        learner.train_step, packing=packed (4D mask)
  - learner, ... varlen    the same under varlen attention
  (agentgrpo.learner.attention.varlen_attention:
                           no mask, no pair across sequences, a shared prompt's keys gathered for
                           each continuation): packed rows of the spread and GRPO-shaped batches,
                           shared_prefix on the GRPO-shaped and long batches
  - learner, padded        packing=padded (one trajectory per row, rows of similar length)
  - learner, packed flex   packing=packed under flex attention (block mask: no pair across
                           sequences, the varlen kernel torch has without flash-attn), and packed
                           segments (learner/attention.py): is packing faster than padding on a GPU
                           with them?
  - learner, shared_prefix the default (a group's prompt computed once), on the GRPO-shaped batch
  - learner, fp32 head     `tf32: false`: the LM head's matmuls in plain fp32 (SIMT on a GPU), the
                           default before 2026-12-04, on the spread and GRPO-shaped batches
  - learner, head chunks   shared_prefix with `head_chunk_tokens: 2048` (the 152k-vocabulary head
                           over chunks of loss tokens, recomputed in backward): its time and peak
                           memory
  - learner, whole groups  on python_math-shaped groups (8 x ~870 tokens, bench/learner_memory.py's
                           long shape): shared_prefix with `row_tokens` = the budget (a whole group
                           per row) against the default `row_tokens: auto` (the attention cost model
                           splits long groups; its FLOP count may undersell masked attention on a
                           GPU)
  - learner, segments      same long groups, `attention: segments` (learner/attention.py: an sdpa
                           call per sequence against its prompt, no mask; whole groups per row): is
                           it faster than the masked default on a GPU too, launches and all?
  - learner, flex          shared_prefix under transformers' flex_attention with a block mask per
                           micro-batch (attention.flex_block_mask: the blocks across
                           sequences skipped, compiled by torch; GPU only), on both GRPO-shaped
                           batches
  - bare fwd+bwd           the same packed micro-batches through the same head-only forward,
                           -sum(logprob) backward and an AdamW step: the learner's overhead baseline
                           (4D mask; `bare fwd+bwd varlen`: under varlen attention, the baseline of
                           `learner packed varlen`)

MFU counts useful FLOPs only: 6 x body parameters per real token, 6 x head parameters per loss token
(the head runs only there), and causal attention 6 x layers x hidden x (context / 2) x 2 per token,
against the H200's dense bf16 peak (989 TFLOP/s; override with --peak-tflops).

    python bench/learner_gpu.py                      # on the GPU machine
    python bench/learner_gpu.py --tiny --device cpu  # smoke test of the script itself
Writes the results as JSON to $OUT/learner_gpu.json when $OUT is set, rewritten after each batch
shape.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from agentgrpo.algo.loss import LossConfig  # noqa: E402
from agentgrpo.learner.batch import make_micro_batches  # noqa: E402
from agentgrpo.learner.learner import Learner, LearnerConfig  # noqa: E402
from bench.learner import Bare, grpo_batch, spread_batch  # noqa: E402
from bench.learner_memory import long_batch  # noqa: E402


def qwen2_shaped(tiny: bool, attn: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if tiny:
        cfg = Qwen2Config(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
            attn_implementation=attn,
        )
    else:
        cfg = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            rope_theta=1e6,
            attn_implementation=attn,
        )
    return Qwen2ForCausalLM(cfg)


def useful_flops(model, trajs) -> float:
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    body = sum(p.numel() for p in model.parameters()) - head  # tied: the embedding is the head
    tokens = sum(len(t.token_ids) for t in trajs)
    loss_tokens = sum(sum(t.loss_mask) for t in trajs)
    attn = sum(
        12 * cfg.num_hidden_layers * cfg.hidden_size * (n * (n + 1) / 2)
        for n in (len(t.token_ids) for t in trajs)
    )
    return 6 * body * tokens + 6 * head * loss_tokens + attn


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(named: dict, repeats: int, device: str) -> dict[str, dict[str, float]]:
    """Seconds per step (median of interleaved repeats) and the step's transient peak memory: the
    peak during the step above what was allocated before it (weights, gradients and optimizer state
    of every variant stay resident: 16 bytes per trained parameter each)."""
    out: dict[str, dict[str, float]] = {}
    for k, fn in list(
        named.items()
    ):  # warm-up (kernels, allocator) and peak memory, one variant at a time
        before = 0
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one broken variant must not cost a rare GPU session the rest
            print(f"  {k}: FAILED, left out: {e!r}", flush=True)
            del named[k]
            continue
        sync(device)
        print(f"  {k}: warm-up step {time.perf_counter() - t0:.1f} s", flush=True)
        peak = (
            (torch.cuda.max_memory_allocated() - before) / 2**30
            if device == "cuda"
            else float("nan")
        )
        out[k] = {"step_peak_gb": peak}
    times: dict[str, list[float]] = {k: [] for k in named}
    for _ in range(repeats):
        for k, fn in named.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    for k, v in times.items():
        out[k]["s"] = statistics.median(v)
    return out


def profile(label: str, fn, device: str) -> None:
    """One warm-up step, then one profiled step: the 25 ops that took the most device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        fn()
        sync(device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(f"\n{label}: one step, ops by self {device} time")
    print(
        prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny config (smoke test on a CPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=int, default=16384, help="learner.micro_batch_tokens")
    p.add_argument("--trajectories", type=int, default=128, help="length-spread batch size")
    p.add_argument("--max-len", type=int, default=2048, help="length spread: 32..max-len tokens")
    p.add_argument("--groups", type=int, default=32, help="GRPO-shaped batch: groups of 8")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    p.add_argument(
        "--shapes", default="spread,grpo,long", help="which batch shapes to run, comma-separated"
    )
    p.add_argument(
        "--variants",
        help="only these learner variants, comma-separated names as printed "
        "(the bare baseline always runs)",
    )
    p.add_argument(
        "--profile",
        metavar="VARIANT",
        help="instead of timing: profile one step of VARIANT "
        "(e.g. 'learner packed') on each selected shape and print its costliest kernels",
    )
    args = p.parse_args()
    if args.tiny:
        args.trajectories, args.max_len, args.groups, args.budget = 8, 200, 2, 1024
    dev = args.device
    model = qwen2_shaped(args.tiny, args.attn)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(
        f"{name}; Qwen2-shaped {n_params / 1e6:.0f}M params; attn {args.attn}; fp32 weights + bf16 "
        f"autocast; micro_batch_tokens {args.budget}; {args.repeats} repeats",
        flush=True,
    )

    def learner(**kw) -> Learner:
        cfg = LearnerConfig(lr=1e-6, micro_batch_tokens=args.budget, autocast="bf16", **kw)
        return Learner(copy.deepcopy(model), cfg, LossConfig())

    results: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "device": name,
        "params_M": n_params / 1e6,
        "attn": args.attn,
        "budget": args.budget,
    }
    spread = spread_batch(args.trajectories, 32, args.max_len, vocab=vocab)
    grpo = grpo_batch(args.groups, 8, vocab=vocab)
    long = long_batch(max(1, args.groups // 4), 8, vocab)
    flex = {"attn_implementation": "flex_attention"}
    mask, varlen = {"attention": "mask"}, {"attention": "varlen"}
    for label, trajs, variants in (
        (
            "spread",
            spread,
            {
                "learner packed": {"packing": "packed", **mask},
                "learner packed varlen": {"packing": "packed", **varlen},
                "learner padded": {"packing": "padded", **mask},
                "learner packed flex": {"packing": "packed", **flex},
                "learner packed segments": {"packing": "packed", "attention": "segments"},
                "learner packed fp32 head": {"packing": "packed", "tf32": False, **mask},
            },
        ),
        (
            "grpo",
            grpo,
            {
                "learner packed": {"packing": "packed", **mask},
                "learner packed varlen": {"packing": "packed", **varlen},
                "learner shared_prefix": mask,
                "learner shared_prefix varlen": varlen,
                "learner shared_prefix fp32 head": {"tf32": False, **mask},
                "learner head chunks": {"head_chunk_tokens": 2048, **mask},
                "learner flex": flex,
            },
        ),
        (
            "long",
            long,
            {
                "learner packed": {"packing": "packed", **mask},
                "learner shared_prefix": mask,
                "learner shared_prefix varlen": varlen,
                "learner whole groups": {"row_tokens": args.budget, **mask},
                "learner segments": {"attention": "segments"},
                "learner flex": flex,
            },
        ),
    ):
        if label not in args.shapes.split(","):
            continue
        named = {}
        for k, kw in variants.items():
            if dev != "cuda" and (
                kw.get("attn_implementation") == "flex_attention" or kw.get("attention") == "varlen"
            ):  # no flex backward on a CPU, no varlen kernel
                continue
            if args.variants and k not in args.variants.split(","):
                continue
            if dev != "cuda" and "tf32" in kw:  # TF32 is CUDA's
                continue
            if "flash" in args.attn and "attention" in kw:  # flash keeps sequences apart itself
                if kw["attention"] != "mask":
                    continue
                kw = {n: v for n, v in kw.items() if n != "attention"}
            try:
                built = learner(**kw)
            except Exception as e:  # noqa: BLE001 - as in `measure`: report it, measure the rest
                print(f"  {k}: FAILED to build, left out: {e!r}", flush=True)
                continue
            named[k] = partial(built.train_step, trajs)
            print(f"  {k}: attention {built.attention.path} ({built.attention.reason})", flush=True)
        bares = {"bare fwd+bwd": False}
        if "learner packed varlen" in named:
            bares["bare fwd+bwd varlen"] = True
        for k, on in bares.items():
            bare = Bare(
                copy.deepcopy(model).to(dev),
                True,
                args.budget,
                autocast=True,
                device=dev,
                tf32=dev == "cuda",
                varlen=on,
            )
            named[k] = partial(bare.step, trajs)
        if args.profile:
            profile(label, named[args.profile], dev)
            continue
        if dev == "cuda":
            torch.cuda.empty_cache()
        r = measure(named, args.repeats, dev)
        tokens = sum(len(t.token_ids) for t in trajs)
        flops = useful_flops(model, trajs)
        mbs = {m: make_micro_batches(trajs, args.budget, mode=m) for m in ("padded", "packed")}
        waste = {m: 1 - tokens / sum(mb.num_tokens for mb in v) for m, v in mbs.items()}
        print(
            f"\n{label}: {len(trajs)} trajectories, {tokens} tokens; padding waste padded "
            f"{waste['padded']:.1%}, packed {waste['packed']:.1%}"
        )
        for k, v in r.items():
            v["tok_s"] = tokens / v["s"]
            v["mfu"] = flops / v["s"] / (args.peak_tflops * 1e12)
            print(
                f"  {k:32s} {v['s']:7.3f} s  {v['tok_s']:9.0f} tok/s  MFU {v['mfu']:6.1%}  "
                f"step peak {v['step_peak_gb']:6.1f} GB"
            )
        pairs = {  # name: (numerator variant, denominator variant, measure), where both ran
            "learner/bare": ("learner packed", "bare fwd+bwd", "s"),
            "learner/bare varlen": ("learner packed varlen", "bare fwd+bwd varlen", "s"),
            "varlen speed-up over the mask (packed)": (
                "learner packed",
                "learner packed varlen",
                "s",
            ),
            "varlen speed-up over the mask (shared_prefix)": (
                "learner shared_prefix",
                "learner shared_prefix varlen",
                "s",
            ),
            "varlen packed speed-up over padded": ("learner padded", "learner packed varlen", "s"),
            "varlen shared_prefix speed-up over varlen packed": (
                "learner packed varlen",
                "learner shared_prefix varlen",
                "s",
            ),
            "packed speed-up over padded": ("learner padded", "learner packed", "s"),
            "packed flex speed-up over padded": ("learner padded", "learner packed flex", "s"),
            "packed segments speed-up over padded": (
                "learner padded",
                "learner packed segments",
                "s",
            ),
            "shared_prefix speed-up over packed": ("learner packed", "learner shared_prefix", "s"),
            "head chunks time": ("learner head chunks", "learner shared_prefix", "s"),
            "head chunks peak memory": (
                "learner head chunks",
                "learner shared_prefix",
                "step_peak_gb",
            ),
            "row_tokens auto speed-up over whole groups": (
                "learner whole groups",
                "learner shared_prefix",
                "s",
            ),
            "segments speed-up over the mask": (
                "learner shared_prefix",
                "learner segments",
                "s",
            ),
            "flex speed-up over the mask": ("learner shared_prefix", "learner flex", "s"),
            "tf32 head speed-up over fp32 (packed)": (
                "learner packed fp32 head",
                "learner packed",
                "s",
            ),
            "tf32 head speed-up over fp32 (shared_prefix)": (
                "learner shared_prefix fp32 head",
                "learner shared_prefix",
                "s",
            ),
        }
        ratios = {name: r[a][m] / r[b][m] for name, (a, b, m) in pairs.items() if a in r and b in r}
        for k, v in ratios.items():
            print(f"  {k}: {v:.3f}x")
        results[label] = {"variants": r, "ratios": ratios, "padding_waste": waste, "tokens": tokens}
        if os.environ.get(
            "OUT"
        ):  # each shape as it ends: a run cut off by a time limit keeps what it measured
            with open(os.path.join(os.environ["OUT"], "learner_gpu.json"), "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
