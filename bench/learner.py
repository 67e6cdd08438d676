"""CPU benchmark of the learner step: packing, head-only logprobs, shared prompts, bf16; all ratios
against baselines measured in the same run (interleaved repeats, median of per-repeat ratios).

Sections:
  1. padded vs packed: trajectories of 20..400 tokens (no shared prompts), tokens/s of a learner
     step and the padding waste of each layout.
  2. overhead: the learner step against a bare forward + backward + AdamW step of the same packed
     micro-batches; once with full logits (what a plain `model(...).logits` loop does) and once with
     the head at loss positions only (the same compute as the learner: the apples-to-apples
     overhead, target <= 1.15x).
  3. GRPO-shaped batch (groups of 8 sharing a ~170-token tool prompt, 20..60-token responses, a
     tool result and a second response): shared_prefix vs packed.
  4. bf16 autocast vs fp32 on the same step; and, with the embedded SmolLM2-135M (forward only), the
     logprob gap bf16 autocast causes against the fp32 logprobs the rollout engine reports.

The default model is a random SmolLM2-shaped network (hidden 576, 9 heads / 3 KV, vocab 49152) with
fewer layers (`--layers`, 30 = the real depth) so the benchmark takes minutes on a shared 2-core
CPU.

    python bench/learner.py [--layers 4] [--repeats 3] [--no-real-model] [--real-step]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# On a CPU shared with other processes, OpenMP threads that spin at barriers wait a whole time slice
# for a descheduled sibling (tens of times slower elementwise ops: docs/performance.md). Passive
# waiting removes that; it must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from agentgrpo.algo.loss import LossConfig  # noqa: E402
from agentgrpo.learner.attention import AUTO_MIN_SHARE, use_segments, use_varlen  # noqa: E402
from agentgrpo.learner.batch import make_micro_batches  # noqa: E402
from agentgrpo.learner.learner import Learner, LearnerConfig  # noqa: E402
from agentgrpo.learner.logprobs import PolicyForward, tf32_matmuls, to_loss_layout  # noqa: E402
from agentgrpo.types import TrainingRow  # noqa: E402


def smol_shaped(layers: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _row(
    ids: list[int],
    mask: list[int],
    group: str,
    rng: random.Random,
    index: int,
    logprobs: list[float] | None = None,
) -> TrainingRow:
    """A training row with random rollout logprobs and advantage ((index * 7) % 5 - 2) / 2: mixed
    signs, some zeros."""
    lps = [-rng.uniform(0.1, 3.0) if m else 0.0 for m in mask]
    rng.random()  # what the trajectory's reward drew: the batches stay those of earlier runs
    return TrainingRow(
        f"{group}/{index}", group, ids, mask, logprobs or lps, ((index * 7) % 5 - 2) / 2
    )


def spread_batch(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 49152) -> list[TrainingRow]:
    """n trajectories of lo..hi tokens, 40% prompt / 60% response, every one its own group."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(lo, hi)
        prompt = max(1, int(length * 0.4))
        ids = [rng.randrange(vocab) for _ in range(length)]
        out.append(_row(ids, [0] * prompt + [1] * (length - prompt), f"s{i}", rng, len(out)))
    return out


def grpo_batch(groups: int, size: int, seed: int = 0, vocab: int = 49152) -> list[TrainingRow]:
    """Tool-use shaped: a 170-token prompt per group; response 20..60, tool result 10..30 (mask 0),
    second response 10..40."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(170)]
        for _ in range(size):
            parts = [
                (prompt, 0),
                (rng.randint(20, 60), 1),
                (rng.randint(10, 30), 0),
                (rng.randint(10, 40), 1),
            ]
            ids, mask = [], []
            for part, m in parts:
                toks = (
                    part if isinstance(part, list) else [rng.randrange(vocab) for _ in range(part)]
                )
                ids += toks
                mask += [m] * len(toks)
            out.append(_row(ids, mask, f"g{g}", rng, len(out)))
    return out


class Bare:
    """A plain accumulation loop on the learner's packed micro-batches: forward, -sum(logprob) at
    loss positions, backward, AdamW step. `head_only` uses the same head-at-loss-positions forward
    as the learner; otherwise the model's full logits. `varlen`: the model switched to varlen
    attention (agentgrpo.learner.attention; CUDA), else on a GPU the 4D mask."""

    def __init__(
        self,
        model,
        head_only: bool,
        budget: int,
        autocast: bool = False,
        device: str = "cpu",
        tf32: bool = False,
        varlen: bool = False,
    ) -> None:
        if varlen:
            use_varlen(model)
        elif device == "cpu":  # the attention the learner's `attention: auto` runs there
            use_segments(model)
        self.forward = PolicyForward(
            model, autocast_bf16=autocast, segment_min_share=AUTO_MIN_SHARE
        ).train()
        self.model, self.head_only, self.budget, self.autocast = model, head_only, budget, autocast
        self.device, self.tf32 = device, tf32
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(self, trajs: list[TrainingRow]) -> None:
        with tf32_matmuls(self.tf32):  # as the learner's tf32 option sets them
            self._step(trajs)

    def _step(self, trajs: list[TrainingRow]) -> None:
        for mb in make_micro_batches(trajs, self.budget, mode="packed"):
            mb = mb.to(self.device)
            if self.head_only:
                lp = self.forward(mb)[0]
            else:
                with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
                    logits = self.model(
                        input_ids=mb.input_ids_RS,
                        position_ids=mb.position_ids_RS,
                        attention_mask=mb.attention_mask_R1SS(),
                    ).logits
                lp = torch.log_softmax(logits.float().flatten(0, 1)[mb.pred_index_M], -1)
                lp = lp.gather(-1, mb.target_ids_M[:, None])
            (-lp.sum()).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compare(named: dict, repeats: int) -> dict[str, list[float]]:
    """Run each callable once as warm-up, then `repeats` interleaved rounds; seconds per round."""
    for fn in named.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in named}
    for _ in range(repeats):
        for k, fn in named.items():
            times[k].append(timed(fn))
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of time(a) / time(b)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def learner(model, **kw) -> Learner:
    return Learner(copy.deepcopy(model), LearnerConfig(lr=1e-6, **kw), LossConfig())


def padding_waste(trajs, mode: str, budget: int) -> float:
    mbs = make_micro_batches(trajs, budget, mode=mode)
    slots = sum(mb.num_tokens for mb in mbs)
    real = sum(len(t.token_ids) for t in trajs)
    return 1 - real / slots


def spread_section(model, n: int, B: int, repeats: int) -> None:
    """1 + 2: length spread, padded vs packed, learner vs bare loops."""
    trajs = spread_batch(n, 20, 400)
    tokens = sum(len(t.token_ids) for t in trajs)
    runs = {
        "learner packed": partial(
            learner(model, packing="packed", micro_batch_tokens=B).train_step, trajs
        ),
        "learner padded": partial(
            learner(model, packing="padded", micro_batch_tokens=B).train_step, trajs
        ),
        "bare head-only": partial(Bare(copy.deepcopy(model), True, B).step, trajs),
        "bare full-logits": partial(Bare(copy.deepcopy(model), False, B).step, trajs),
    }
    t = compare(runs, repeats)
    print(f"1. {len(trajs)} trajectories of 20..400 tokens ({tokens} tokens)")
    for k, v in t.items():
        print(
            f"   {k:18s} {statistics.median(v):6.2f} s/step  "
            f"{tokens / statistics.median(v):7.0f} tok/s"
        )
    print(
        f"   padding waste: padded {padding_waste(trajs, 'padded', B):.1%}, packed "
        f"{padding_waste(trajs, 'packed', B):.1%}"
    )
    print(f"   packed / padded throughput: {ratio(t, 'learner padded', 'learner packed'):.2f}x")
    print(
        f"2. learner step / bare fwd+bwd+AdamW, head-only (same compute): "
        f"{ratio(t, 'learner packed', 'bare head-only'):.3f}x (target <= 1.15)"
    )
    print(
        "   learner step / bare loop with full logits: "
        f"{ratio(t, 'learner packed', 'bare full-logits'):.3f}x"
    )


def grpo_section(model, B: int, repeats: int) -> None:
    """3 + 4: GRPO-shaped batch: shared prompt, bf16."""
    g = grpo_batch(groups=4, size=8)
    gtok = sum(len(x.token_ids) for x in g)
    shared = make_micro_batches(g, B, mode="shared_prefix")
    runs = {
        "packed": partial(learner(model, packing="packed", micro_batch_tokens=B).train_step, g),
        "shared_prefix": partial(learner(model, micro_batch_tokens=B).train_step, g),
        "shared_prefix bf16": partial(
            learner(model, micro_batch_tokens=B, autocast="bf16").train_step, g
        ),
    }
    t = compare(runs, repeats)
    print(
        f"3. GRPO-shaped: 4 groups x 8, 170-token prompt ({gtok} trajectory tokens, "
        f"{sum(mb.num_real_tokens for mb in shared)} computed with the prompt shared)"
    )
    for k, v in t.items():
        print(
            f"   {k:20s} {statistics.median(v):6.2f} s/step  "
            f"{gtok / statistics.median(v):7.0f} trajectory tok/s"
        )
    print(f"   shared_prefix speed-up over packed: {ratio(t, 'packed', 'shared_prefix'):.2f}x")
    print(
        "4. bf16 autocast speed-up (shared_prefix): "
        f"{ratio(t, 'shared_prefix', 'shared_prefix bf16'):.2f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=int, default=4096, help="learner.micro_batch_tokens")
    p.add_argument("--trajectories", type=int, default=24)
    p.add_argument(
        "--no-real-model", action="store_true", help="skip the SmolLM2-135M logprob-gap section"
    )
    p.add_argument(
        "--real-step",
        action="store_true",
        help="also time learner steps of SmolLM2-135M itself on the GRPO-shaped batch (minutes)",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    model = smol_shaped(args.layers)
    B = args.budget
    print(
        f"model: SmolLM2-shaped, {args.layers} layers, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params; torch threads "
        f"{torch.get_num_threads()}; micro_batch_tokens {B}; {args.repeats} interleaved repeats\n"
    )

    spread_section(model, args.trajectories, B, args.repeats)  # each section frees its learners
    grpo_section(model, B, args.repeats)
    if not args.no_real_model:
        real_model_gap()
    if args.real_step:
        real_model_steps(B)


def real_model_steps(budget: int) -> None:
    """5. The embedded SmolLM2-135M on the GRPO-shaped batch, what the embedded run pays per step:
    shared_prefix fp32 / bf16 autocast and packed fp32. One learner at a time (each holds ~2 GB of
    weights, gradients and Adam state, plus ~1.3 MB of fp32 activations per token in the step);
    the first step of each is a warm-up, the second is timed."""
    import gc

    from transformers import AutoModelForCausalLM

    from agentgrpo.models.embedded import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    g = grpo_batch(groups=4, size=8)
    gtok = sum(len(x.token_ids) for x in g)
    variants = {
        "shared_prefix fp32": {},
        "shared_prefix bf16": {"autocast": "bf16"},
        "packed fp32": {"packing": "packed"},
    }
    t: dict[str, list[float]] = {}
    for k, kw in variants.items():
        L = learner(model, micro_batch_tokens=budget, **kw)
        rss = L.train_step(g).get("mem/rss_peak_gb", float("nan"))
        t[k] = [timed(partial(L.train_step, g))]
        del L
        gc.collect()
    print(
        f"5. SmolLM2-135M learner step, 4 groups x 8 ({gtok} trajectory tokens), "
        f"micro_batch_tokens {budget}:"
    )
    for k, v in t.items():
        print(f"   {k:20s} {v[0]:6.1f} s/step  {gtok / v[0]:6.0f} trajectory tok/s")
    print(
        f"   bf16 autocast speed-up {ratio(t, 'shared_prefix fp32', 'shared_prefix bf16'):.2f}x; "
        f"shared_prefix over packed {ratio(t, 'packed fp32', 'shared_prefix fp32'):.2f}x; "
        f"process peak RSS {rss:.1f} GB"
    )


def real_model_gap(samples: int = 8, new_tokens: int = 48) -> None:
    """Rollout logprobs (fp32 sampling, KV cache) vs the learner's head-only logprobs in fp32 and
    with bf16 autocast, on SmolLM2-135M-Instruct's own samples of a calculator-env prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgrpo.chat.format import ChatFormat
    from agentgrpo.models.embedded import default_model_path
    from envs.calculator import CalculatorEnv

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    env = CalculatorEnv()
    task = CalculatorEnv.load_tasks("train", seed=0, n=1)[0]
    messages, _ = env.reset(seed=0, options={"task": task})
    prompt = ChatFormat(tok).prompt_ids(messages, env.tool_schemas())
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            num_return_sequences=samples,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.eos_token_id,
        )
    trajs = []
    rng = random.Random(0)
    for i in range(samples):
        resp = out.sequences[i, len(prompt) :].tolist()
        lps = [
            torch.log_softmax(s[i].float(), -1)[t].item()
            for s, t in zip(out.scores, resp, strict=False)
        ]
        n = len(lps)
        ids, mask = prompt + resp[:n], [0] * len(prompt) + [1] * n
        trajs.append(_row(ids, mask, "g", rng, i, logprobs=[0.0] * len(prompt) + lps))
    gaps = {}
    for name, bf16 in (("fp32", False), ("bf16 autocast", True)):
        fwd = PolicyForward(model, autocast_bf16=bf16)
        diffs = []
        with torch.no_grad():
            for mb in make_micro_batches(trajs, 8192):
                lp_BT = to_loss_layout(fwd(mb)[0], mb)
                m = mb.loss_mask_BT > 0
                diffs.append((lp_BT[m] - mb.rollout_logprobs_BT[m]).abs())
        d = torch.cat(diffs)
        gaps[name] = (float(d.mean()), float(d.max()))
    print(
        f"   SmolLM2-135M, {samples} samples x {new_tokens} tokens of a {len(prompt)}-token "
        "calculator prompt:"
    )
    for name, (mean, mx) in gaps.items():
        print(f"   |learner - rollout| logprob, learner {name:13s}: mean {mean:.2e}, max {mx:.2e}")


if __name__ == "__main__":
    main()
