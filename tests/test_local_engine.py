"""LocalEngine: batched in-process generation whose logprobs match a fresh forward pass.

Most tests use a tiny random Llama (2 layers, hidden 32); two use the real SmolLM2.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentgrpo.engine import Engine, EngineError, LocalEngine, SamplingParams
from agentgrpo.engine.local.batch import _Batch
from agentgrpo.engine.local.prefix_cache import PrefixCache, common_prefix_len, shared_prefixes
from agentgrpo.engine.local.sampling import sample

VOCAB = 320
CONTEXT = 64


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def tiny_model(seed: int = 0, eos: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=CONTEXT,
        bos_token_id=1, eos_token_id=eos, pad_token_id=0, tie_word_embeddings=True,
        initializer_range=0.5,  # peaky distributions, so greedy and sampling differ visibly
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def model():
    return tiny_model()


@pytest.fixture
def engine(model):
    """No EOS ids, so lengths are exact unless a test asks for stop ids."""
    with LocalEngine(model, seed=0, eos_token_ids=()) as eng:
        yield eng


def fresh_logprobs(
    model, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) at the completion ids, from one unbatched forward without a cache."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def assert_matches_fresh_forward(model, prompt, completion, temperature, atol=1e-4):
    assert len(completion.token_ids) == len(completion.logprobs) > 0
    expected = fresh_logprobs(model, prompt, completion.token_ids, temperature)
    got = torch.tensor(completion.logprobs)
    assert torch.allclose(got, expected, atol=atol, rtol=0), (got - expected).abs().max()


# ------------------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_batched_logprobs_equal_a_fresh_forward(model, engine, temperature):
    prompts = [[5], list(range(10, 40)), [9] * 12, [3, 4, 7, 8, 100]]
    max_new = [20, 12, 25, 7]
    outs = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(max_new_tokens=n, temperature=temperature))
            for p, n in zip(prompts, max_new, strict=True)
        )
    )
    assert engine.stats["max_rows"] == 4  # they really were decoded together
    for prompt, n, out in zip(prompts, max_new, outs, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == n
        assert_matches_fresh_forward(model, prompt, out, temperature)
    if temperature == 0:  # greedy: each token is the argmax of the fresh forward
        for prompt, out in zip(prompts, outs, strict=True):
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + out.token_ids])).logits[
                    0, len(prompt) - 1 : -1
                ]
            assert logits.argmax(-1).tolist() == out.token_ids


async def test_requests_joining_a_running_batch_keep_exact_logprobs(model, engine):
    """Continuous batching: rows join mid-decode with longer and shorter prompts than the running
    cache, and leave early; every row still matches its own unbatched forward."""

    async def until(stat: str, n: int) -> None:
        while engine.stats[stat] < n:
            await asyncio.sleep(0.001)

    first_prompt, long_prompt = [7, 8, 9, 10, 11, 12, 13, 14], list(range(50, 80))
    first = asyncio.create_task(engine.generate(first_prompt, SamplingParams(max_new_tokens=56)))
    await until("steps", 3)  # the running cache is ~11 columns wide: the running row gets padded
    long = asyncio.create_task(engine.generate(long_prompt, SamplingParams(max_new_tokens=15)))
    await until("prefills", 2)
    await until("steps", engine.stats["steps"] + 2)  # ~33 columns: the one-token prompt gets padded
    short = asyncio.create_task(engine.generate([4], SamplingParams(max_new_tokens=5)))
    out_short = await short
    assert not first.done()  # the short request did not wait for the long-running one
    out_first, out_long = await first, await long
    assert engine.stats["prefills"] == 3 and engine.stats["max_rows"] == 3
    assert_matches_fresh_forward(model, first_prompt, out_first, 1.0)
    assert_matches_fresh_forward(model, long_prompt, out_long, 1.0)
    assert_matches_fresh_forward(model, [4], out_short, 1.0)


async def test_long_prompts_are_prefilled_in_chunks_with_the_same_result(model):
    prompt = list(range(3, 50))
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    with LocalEngine(model, eos_token_ids=(), prefill_tokens=8) as small:
        chunked = await small.generate(prompt, params)
        assert small.stats["prefills"] == 1
    assert_matches_fresh_forward(model, prompt, chunked, 0.0)


def test_sample_hand_computed_distribution():
    # p = [0.5, 0.3, 0.15, 0.05]. top_p = 0.7 keeps {0.5, 0.3} (mass before 0.15 is 0.8 >= 0.7),
    # renormalised to [0.625, 0.375]; so u < 0.625 picks token 0, u >= 0.625 picks token 1.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(4, 1)
    ids, logprobs = sample(
        logits, temperature=[1.0, 1.0, 1.0, 0.0], top_k=[-1, -1, 3, -1], top_p=[0.7, 0.7, 0.9, 1.0],
        uniforms=torch.tensor([0.6, 0.7, 0.99, 0.99], dtype=torch.float64),
    )  # fmt: skip
    assert ids.tolist() == [0, 1, 2, 0]
    # row 2: top_k=3 renormalises to [0.5, 0.3, 0.15] / 0.95; mass before the third is 0.842 < 0.9,
    # so top_p keeps it. Row 3 is greedy: the argmax. Logprobs are the full distribution's, before
    # truncation (SGLang's convention and the learner's): log 0.5, log 0.3, log 0.15, log 0.5.
    expected = [math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.5)]
    assert logprobs.tolist() == pytest.approx(expected, abs=1e-6)


def test_sample_follows_the_tempered_distribution_exactly():
    # Inverse-CDF sampling on a uniform grid of u hits each token in proportion to its probability.
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    temperature = 2.0  # softmax(log p / 2) ∝ sqrt(p)
    tempered = probs.sqrt() / probs.sqrt().sum()
    n = 10_000
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    ids, logprobs = sample(
        probs.log().repeat(n, 1), temperature=[temperature] * n, top_k=[-1] * n, top_p=[1.0] * n,
        uniforms=uniforms,
    )  # fmt: skip
    counts = torch.bincount(ids, minlength=4) / n
    assert torch.allclose(counts, tempered, atol=2e-4)
    assert torch.allclose(logprobs, tempered.log()[ids], atol=1e-6)


async def test_top_k_and_top_p_sample_the_truncated_set_and_report_full_logprobs(model, engine):
    prompt = [5, 6, 7]
    out = await engine.generate(prompt, SamplingParams(max_new_tokens=10, top_k=3, temperature=0.8))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1] / 0.8
    top_ids = logits.topk(3, dim=-1).indices
    for i, tok in enumerate(out.token_ids):
        assert tok in top_ids[i].tolist()
        assert out.logprobs[i] == pytest.approx(
            torch.log_softmax(logits[i], -1)[tok].item(), abs=1e-4
        )

    out = await engine.generate(prompt, SamplingParams(max_new_tokens=10, top_p=0.5))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    for i, tok in enumerate(out.token_ids):
        probs, order = torch.softmax(logits[i], -1).sort(descending=True)
        keep = int(((probs.cumsum(0) - probs) < 0.5).sum())  # smallest prefix reaching 0.5
        kept = order[:keep].tolist()
        assert tok in kept
        assert out.logprobs[i] == pytest.approx(probs[kept.index(tok)].log().item(), abs=1e-4)


# ------------------------------------------------------------------------------ finish reasons
async def test_stop_token_is_returned_last_with_reason_stop(model, engine):
    prompt = [11, 12, 13]
    free = await engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert free.finish_reason == "length" and free.detail == ""
    stop_id = free.token_ids[4]
    cut = free.token_ids.index(stop_id) + 1
    out = await engine.generate(
        prompt, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop_id,))
    )
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[:cut] and out.token_ids[-1] == stop_id
    assert out.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-5)


async def test_model_eos_ends_a_request(model):
    prompt = [11, 12, 13]
    with LocalEngine(model, eos_token_ids=()) as eng:
        free = await eng.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.0))
    eos = free.token_ids[3]
    model.config.eos_token_id = eos  # the engine reads the model's own EOS ids by default
    model.generation_config.eos_token_id = eos
    with LocalEngine(model) as eng:
        assert eos in eng.eos_token_ids
        out = await eng.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    assert out.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]


async def test_context_length_clamps_max_new_tokens(engine):
    out = await engine.generate(list(range(3, 63)), SamplingParams(max_new_tokens=100))
    assert out.finish_reason == "length" and len(out.token_ids) == CONTEXT - 60
    assert "context length 64" in out.detail
    full = await engine.generate([5] * CONTEXT, SamplingParams(max_new_tokens=4))
    assert (full.token_ids, full.finish_reason) == ([], "length")
    assert "fills the context length 64" in full.detail
    # A budget that fits is not clamped and says nothing.
    fits = await engine.generate(list(range(3, 63)), SamplingParams(max_new_tokens=4))
    assert (len(fits.token_ids), fits.detail) == (4, "")


async def test_bad_prompts_are_rejected_before_queueing(engine):
    with pytest.raises(ValueError, match="vocabulary"):
        await engine.generate([1, VOCAB], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        await engine.generate([], SamplingParams())
    assert engine.stats["prefills"] == 0


# --------------------------------------------------------------------------------- concurrency
async def test_many_tasks_share_batches_off_the_event_loop(model):
    forward_threads: set[int] = set()
    model.register_forward_pre_hook(lambda *_: forward_threads.add(threading.get_ident()))
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    with LocalEngine(model, max_batch_size=8, eos_token_ids=()) as eng:
        tick_task = asyncio.create_task(ticker())
        prompts = [list(range(3, 3 + 1 + i % 9)) for i in range(40)]
        params = [SamplingParams(max_new_tokens=5 + i % 13, seed=i) for i in range(40)]
        outs = await asyncio.gather(
            *(eng.generate(p, q) for p, q in zip(prompts, params, strict=True))
        )
        tick_task.cancel()
        assert 1 < eng.stats["max_rows"] <= 8
        assert threading.get_ident() not in forward_threads  # torch never ran on the loop thread
        # The loop kept running other tasks while the engine worked (hundreds of thousands of
        # ticks here; a generate that blocked the loop would leave about one tick per request).
        assert ticks > 1000
        for prompt, param, out in zip(prompts, params, outs, strict=True):
            assert len(out.token_ids) == param.max_new_tokens
            assert_matches_fresh_forward(model, prompt, out, 1.0)
        # A seeded request gives the same tokens alone as it did inside a batch of 8.
        alone = await eng.generate(prompts[17], params[17])
        assert alone.token_ids == outs[17].token_ids


async def test_seeds_make_requests_reproducible_and_distinct(engine):
    prompt = [20, 21, 22]
    a1 = await engine.generate(prompt, SamplingParams(max_new_tokens=20, seed=1))
    a2 = await engine.generate(prompt, SamplingParams(max_new_tokens=20, seed=1))
    b = await engine.generate(prompt, SamplingParams(max_new_tokens=20, seed=2))
    unseeded = await asyncio.gather(
        *(engine.generate(prompt, SamplingParams(max_new_tokens=20)) for _ in range(2))
    )
    assert a1.token_ids == a2.token_ids
    assert a1.token_ids != b.token_ids
    assert unseeded[0].token_ids != unseeded[1].token_ids


async def test_the_engine_never_touches_torchs_global_rng(model):
    """Unseeded requests draw from the engine's own generator (seeded by `seed=`, else at random):
    building or using the engine leaves torch's global RNG where the caller's seed put it."""
    prompt = [20, 21, 22]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    outs = []
    for seed in (None, None, 7, 7):
        async with LocalEngine(model, seed=seed, eos_token_ids=()) as eng:
            outs.append((await eng.generate(prompt, SamplingParams(max_new_tokens=20))).token_ids)
        assert torch.equal(torch.get_rng_state(), state)
    assert outs[2] == outs[3] and outs[0] != outs[1]  # seed= reproduces; None: independent draws


def test_training_builds_the_local_engine_with_the_runs_seed(tiny_model_dir):
    from transformers import AutoTokenizer

    from agentgrpo.engine.config import build_engine
    from agentgrpo.run.config import load_config

    cfg = load_config(None, ["seed=7", "engine.partial_rollouts=true"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with build_engine(cfg.engine, tiny_model_dir, tokenizer, seed=cfg.seed) as eng:
        assert eng._generator.initial_seed() == 7
        assert eng.partial_rollouts
        assert eng.device == torch.device("cpu")  # device auto, no learner device given


def test_the_local_engine_decodes_on_the_learners_device_unless_told(monkeypatch):
    from agentgrpo.engine import config as engine_config
    from agentgrpo.run.config import load_config

    made = []
    monkeypatch.setattr(engine_config, "LocalEngine", lambda *a, **kw: made.append(kw["device"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for setting, learner, expected in [
        ("auto", "cuda:0", "cuda:0"),  # beside the learner on rank 0's GPU
        ("auto", None, "cpu"),
        ("cpu", "cuda:0", "cpu"),
        ("cuda:1", "cuda:0", "cuda:1"),
    ]:
        cfg = load_config(None, [f"engine.device={setting}"])
        engine_config.build_engine(cfg.engine, "m", None, seed=0, learner_device=learner)
        assert made.pop() == expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="engine.device=cuda: torch sees no CUDA device"):
        cfg = load_config(None, ["engine.device=cuda"])
        engine_config.build_engine(cfg.engine, "m", None, seed=0)


async def test_cancelled_request_leaves_the_batch(engine):
    slow = asyncio.create_task(engine.generate([5, 6], SamplingParams(max_new_tokens=60)))
    other = asyncio.create_task(engine.generate([7, 8], SamplingParams(max_new_tokens=30)))
    while engine.stats["steps"] < 2:
        await asyncio.sleep(0.001)
    slow.cancel()
    out = await other
    assert len(out.token_ids) == 30
    with pytest.raises(asyncio.CancelledError):
        await slow
    await engine.update_weights({}, version="barrier")  # an update waits until no row is running
    assert engine.stats["tokens"] < 60 + 30  # the cancelled row stopped decoding


async def test_close_aborts_in_flight_requests(model):
    eng = LocalEngine(model, eos_token_ids=())
    task = asyncio.create_task(eng.generate([5, 6], SamplingParams(max_new_tokens=60)))
    while eng.stats["steps"] < 2:
        await asyncio.sleep(0.001)
    await eng.aclose()
    out = await task
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 60
    assert out.detail == "engine closed"
    with pytest.raises(EngineError):
        await eng.generate([5, 6], SamplingParams(max_new_tokens=2))


async def test_close_during_the_batch_window_aborts_the_arrivals(model):
    # The idle worker sleeps batch_window_s after the first arrival; close() comes in that window,
    # so the stop is found in the same pass that would admit the requests.
    eng = LocalEngine(model, eos_token_ids=(), batch_window_s=0.3, prefix_cache_tokens=0)
    tasks = [asyncio.create_task(eng.generate([5, 6, 7 + i], SamplingParams(max_new_tokens=20)))
             for i in range(2)]  # fmt: skip
    await asyncio.sleep(0.05)
    await eng.aclose()
    outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert [(o.finish_reason, o.token_ids, o.detail) for o in outs] == [
        ("abort", [], "engine closed")
    ] * 2


async def test_close_aborts_running_and_queued_requests(model):
    # max_batch_size=1: one request runs, two wait for its slot. close() ends all three at once,
    # without running the queue first.
    eng = LocalEngine(model, eos_token_ids=(), max_batch_size=1, prefix_cache_tokens=0)
    tasks = [asyncio.create_task(eng.generate([5, 6, 7 + i], SamplingParams(max_new_tokens=60)))
             for i in range(3)]  # fmt: skip
    while eng.stats["steps"] < 2:
        await asyncio.sleep(0.001)
    await eng.aclose()
    running, *queued = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert running.finish_reason == "abort" and 0 < len(running.token_ids) < 60
    assert [(o.finish_reason, o.token_ids) for o in queued] == [("abort", [])] * 2
    assert eng.stats["tokens"] < 60


def test_local_engine_satisfies_the_engine_protocol(engine):
    assert isinstance(engine, Engine)


def test_the_cache_goes_under_the_name_the_forward_takes():
    # transformers 5.2x renamed past_key_values to cache; under the wrong name the kwarg would land
    # in **kwargs and every decode step would silently run without the KV cache.
    from agentgrpo.engine.local.engine import _cache_kwarg

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, past_key_values=None, **kwargs): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class NoCache(torch.nn.Module):
        def forward(self, input_ids, **kwargs): ...

    assert _cache_kwarg(New()) == "cache"
    assert _cache_kwarg(Old()) == "past_key_values"
    with pytest.raises(NotImplementedError, match="NoCache.forward takes no KV cache"):
        _cache_kwarg(NoCache())


# ------------------------------------------------------------------------ weights and scoring
async def test_update_weights_changes_outputs_and_version(model):
    prompt = [30, 31, 32, 33]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    new_model = tiny_model(seed=1)
    with LocalEngine(model, eos_token_ids=(), weight_version="v0") as eng:
        before = await eng.generate(prompt, greedy)
        assert before.weight_version == "v0"
        await eng.update_weights(new_model.state_dict(), version="v1")
        after = await eng.generate(prompt, greedy)
        assert after.weight_version == "v1" and eng.weight_version == "v1"
        assert after.token_ids != before.token_ids
        assert_matches_fresh_forward(new_model, prompt, after, 0.0)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        scored = await eng.score(prompt, before.token_ids)
        expected = fresh_logprobs(new_model, prompt, before.token_ids, 1.0)
        assert torch.allclose(torch.tensor(scored), expected, atol=1e-4)


async def test_update_weights_from_a_safetensors_directory(model, tmp_path):
    from safetensors.torch import save_file

    new_model = tiny_model(seed=3)
    state = {k: v for k, v in new_model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, tmp_path / "model.safetensors")
    with LocalEngine(model, eos_token_ids=()) as eng:
        await eng.update_weights(tmp_path, version="3")
        out = await eng.generate([9, 9], SamplingParams(max_new_tokens=6, temperature=0.0))
    assert out.weight_version == "3"
    assert_matches_fresh_forward(new_model, [9, 9], out, 0.0)


async def test_bad_weights_are_rejected_without_changing_anything(model, engine):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = tiny_model(seed=4).state_dict()
    with pytest.raises(ValueError, match="unknown names"):
        await engine.update_weights({**good, "nope.weight": torch.zeros(1)}, version="x")
    wrong_shape = {**good, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="shape"):
        await engine.update_weights(wrong_shape, version="x")
    assert engine.weight_version is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


async def test_update_waits_for_running_requests(model, engine):
    """A completion comes from one weight version: the update lands after in-flight rows finish."""
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    running = asyncio.create_task(engine.generate([5, 6, 7], params))
    while engine.stats["steps"] < 2:
        await asyncio.sleep(0.001)
    await engine.update_weights(tiny_model(seed=5).state_dict(), version="new")
    assert running.done()
    out = running.result()
    assert out.weight_version is None and len(out.token_ids) == 30
    assert_matches_fresh_forward(tiny_model(seed=0), [5, 6, 7], out, 0.0)


def hold_after_step(monkeypatch, n: int) -> tuple[threading.Event, threading.Event]:
    """Make the worker stop after its n-th decode step until the test sets `go`; `held` is set
    when it stops there. Lets a test queue an update at an exact point of a request."""
    held, go = threading.Event(), threading.Event()
    step = _Batch.step

    def holding_step(self):
        step(self)
        if self.engine.stats["steps"] == n:
            held.set()
            go.wait(10)

    monkeypatch.setattr(_Batch, "step", holding_step)
    return held, go


async def test_partial_rollouts_keep_tokens_and_kv_across_an_update(model, monkeypatch):
    """An update lands after decode step 4: the request keeps its first 5 ids (1 sampled from the
    prefill, 4 from the steps) and their logprobs, which the old weights computed, samples the
    other 25 with the new weights over the KV cache the old weights wrote (prompt + the first 4
    ids; the 5th is fed after the update), and reports the split."""
    prompt, params = [5, 6, 7], SamplingParams(max_new_tokens=30, temperature=0.0)
    old, new = tiny_model(seed=0), tiny_model(seed=5)
    held, go = hold_after_step(monkeypatch, 4)
    with LocalEngine(model, eos_token_ids=(), weight_version="1", partial_rollouts=True) as eng:
        running = asyncio.create_task(eng.generate(prompt, params))
        await asyncio.to_thread(held.wait, 10)
        update = asyncio.create_task(eng.update_weights(new.state_dict(), version="2"))
        await asyncio.sleep(0)  # the update is queued: release the worker
        go.set()
        await update
        assert not running.done()  # it landed while the request was still decoding
        out = await running
        assert len(eng.prefix_cache) == 0  # the row's mixed KV was not kept for new requests
        before = dict(eng.stats)
        turn2 = prompt + out.token_ids
        nxt = await eng.generate(turn2, SamplingParams(max_new_tokens=4, temperature=0.0))
        assert prefill_delta(eng, before) == (len(turn2), 0)
        cache_kwarg = eng.cache_kwarg
    assert out.version_runs == [(5, "1"), (25, "2")] and out.weight_version == "2"
    assert out.token_version_runs == [(5, "1"), (25, "2")]
    ids = out.token_ids
    # The first 5: the old weights alone (a fresh forward of the old model).
    first = fresh_logprobs(old, prompt, ids[:5], 0.0)
    assert torch.allclose(torch.tensor(out.logprobs[:5]), first, atol=1e-4, rtol=0)
    # The rest: the new weights fed ids[4:] over the old model's cache of prompt + ids[:4].
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=old.config)
        old(input_ids=torch.tensor([prompt + ids[:4]]), use_cache=True, **{cache_kwarg: cache})
        logits = new(
            input_ids=torch.tensor([ids[4:-1]]), use_cache=True, **{cache_kwarg: cache}
        ).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    assert ids[5:] == logp.argmax(-1).tolist()  # greedy under the mixed cache
    expected = logp.gather(-1, torch.tensor(ids[5:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs[5:]), expected, atol=1e-4, rtol=0)
    # Neither version alone gives those numbers: the old KV was kept, not recomputed.
    assert not torch.allclose(
        torch.tensor(out.logprobs[5:]), fresh_logprobs(new, prompt + ids[:5], ids[5:], 0.0),
        atol=1e-2,
    )  # fmt: skip
    # The next turn, admitted after the update, is the new weights' alone, one version.
    assert nxt.version_runs is None and nxt.weight_version == "2"
    assert_matches_fresh_forward(new, turn2, nxt, 0.0)


async def test_partial_rollouts_admit_behind_an_update_and_one_version_stays_unsplit(
    model, monkeypatch
):
    """Requests queued behind the update are not held back by the running row; a request that
    runs entirely under one version reports no runs (None), as without partial rollouts."""
    new = tiny_model(seed=5)
    held, go = hold_after_step(monkeypatch, 2)
    with LocalEngine(model, eos_token_ids=(), weight_version="1", partial_rollouts=True) as eng:
        long = asyncio.create_task(eng.generate([5, 6], SamplingParams(max_new_tokens=40)))
        await asyncio.to_thread(held.wait, 10)
        update = asyncio.create_task(eng.update_weights(new.state_dict(), version="2"))
        short = asyncio.create_task(eng.generate([9, 9], SamplingParams(max_new_tokens=3)))
        await asyncio.sleep(0)
        go.set()
        after = await short
        assert update.done() and not long.done()
        out = await long
    assert out.version_runs == [(3, "1"), (37, "2")]
    assert after.version_runs is None and after.weight_version == "2"
    assert_matches_fresh_forward(new, [9, 9], after, 1.0)


async def test_partial_rollouts_an_update_passes_requests_waiting_for_a_row(model, monkeypatch):
    """A full batch (1 row) and a request queued before the update: the update does not wait for a
    row to free up; the queued request then starts under the new weights."""
    new = tiny_model(seed=5)
    held, go = hold_after_step(monkeypatch, 2)
    with LocalEngine(
        model, eos_token_ids=(), weight_version="1", partial_rollouts=True, max_batch_size=1
    ) as eng:
        running = asyncio.create_task(eng.generate([5, 6], SamplingParams(max_new_tokens=40)))
        await asyncio.to_thread(held.wait, 10)
        queued = asyncio.create_task(eng.generate([9, 9], SamplingParams(max_new_tokens=3)))
        update = asyncio.create_task(eng.update_weights(new.state_dict(), version="2"))
        await asyncio.sleep(0)
        go.set()
        await update
        assert not running.done() and not queued.done()
        out, after = await running, await queued
    assert out.version_runs == [(3, "1"), (37, "2")]
    assert after.version_runs is None and after.weight_version == "2"
    assert_matches_fresh_forward(new, [9, 9], after, 1.0)


async def test_score_matches_generation_logprobs(model, engine):
    prompt = [40, 41]
    for temperature in (1.0, 0.5, 0.0):
        out = await engine.generate(
            prompt, SamplingParams(max_new_tokens=8, temperature=temperature)
        )
        scored = await engine.score(prompt, out.token_ids, temperature=temperature)
        assert scored == pytest.approx(out.logprobs, abs=1e-4)
    assert await engine.score(prompt, []) == []


# ------------------------------------------------------------------------- the embedded model
@pytest.fixture(scope="module")
def smollm2():
    from agentgrpo.models.embedded import default_model_path

    with LocalEngine(default_model_path(), seed=0) as eng:
        yield eng


async def test_smollm2_batched_logprobs_equal_a_fresh_forward(smollm2):
    tok = smollm2.tokenizer
    questions = [
        "Hi",
        "Name three colours of the rainbow.",
        "What is 12 times 7? Explain your steps.",
    ]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in questions
    ]
    outs = await asyncio.gather(
        *(smollm2.generate(p, SamplingParams(max_new_tokens=8, temperature=1.0)) for p in prompts)
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_fresh_forward(smollm2.model, prompt, out, 1.0)


async def test_smollm2_stops_at_im_end(smollm2):
    tok = smollm2.tokenizer
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(question, add_generation_prompt=True)["input_ids"]
    out = await smollm2.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0.0))
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert "Paris" in tok.decode(out.token_ids)


# ------------------------------------------------------------------------------ prefix cache
def test_common_prefix_len_and_shared_prefixes():
    assert common_prefix_len((1, 2, 3, 4), (1, 2, 9)) == 2
    assert common_prefix_len((1, 2), (1, 2, 3)) == 2
    assert common_prefix_len((5,), (6,)) == 0
    assert common_prefix_len(tuple(range(1000)), tuple(range(999)) + (7,)) == 999
    system, a, b = [1] * 20, [2] * 18, [3] * 18
    # Copies of A share A minus its last id (each request feeds its last id itself); A and B share
    # the system prompt, C only its first 3 ids.
    prompts = [system + a] * 3 + [system + b] * 2 + [system[:3] + [9] * 30]
    assert shared_prefixes(prompts) == {
        tuple(system[:3]): 6,
        tuple(system): 5,
        tuple(system + a[:-1]): 3,
        tuple(system + b[:-1]): 2,
    }
    assert shared_prefixes([system + a, system + b]) == {tuple(system): 2}
    assert shared_prefixes([[1], [1], [2, 3]]) == {}  # a one-id prompt has nothing to share


def kv(n: int, fill: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer KV rows for n ids (2 layers, 1 head, dim 2) whose values say which id they are."""
    rows = torch.arange(n, dtype=torch.float32)[None, :, None].expand(1, n, 2) + fill
    return [rows.clone(), rows.clone()], [rows.clone(), rows.clone()]


def test_prefix_cache_lru_budget_and_coverage():
    cache = PrefixCache(max_tokens=10)
    assert cache.insert((1, 2, 3, 4), *kv(4))
    assert cache.insert((5, 6, 7, 8), *kv(4))
    entry, n = cache.lookup([1, 2, 3, 9, 9])  # partial hit: the first 3 rows are reusable
    assert n == 3 and entry.ids == (1, 2, 3, 4)  # and (1, 2, 3, 4) is now the most recent
    assert cache.insert((10, 11, 12), *kv(3))  # 11 tokens > 10: the least recently used goes
    assert cache.keys() == [(1, 2, 3, 4), (10, 11, 12)] and cache.tokens == 7
    assert not cache.insert((1, 2, 3), *kv(3))  # covered by (1, 2, 3, 4): not stored twice
    assert cache.keys() == [(10, 11, 12), (1, 2, 3, 4)]  # ... but marked recently used
    assert cache.insert((10, 11, 12, 13, 14), *kv(5, fill=0.5))  # covers and replaces (10, 11, 12)
    assert cache.keys() == [(1, 2, 3, 4), (10, 11, 12, 13, 14)] and cache.tokens == 9
    assert cache.lookup([10, 11, 12])[0].keys[0][0, 2].tolist() == [2.5, 2.5]
    assert not cache.insert(tuple(range(11)), *kv(11))  # longer than the whole budget
    assert cache.lookup([99]) == (None, 0)
    with pytest.raises(ValueError, match="do not match"):
        cache.insert((20, 21), *kv(3))
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0
    off = PrefixCache(max_tokens=0)
    assert not off.enabled and not off.insert((1,), *kv(1)) and len(off) == 0


def prefill_delta(engine, before: dict[str, int]) -> tuple[int, int]:
    """(ids fed to prefill forwards, ids taken from the prefix cache) since `before`."""
    return (
        engine.stats["prefill_tokens"] - before["prefill_tokens"],
        engine.stats["cached_tokens"] - before["cached_tokens"],
    )


async def test_a_group_of_identical_prompts_is_prefilled_once(model):
    prompt = list(range(3, 33))  # 30 ids
    params = [SamplingParams(max_new_tokens=12, seed=i) for i in range(8)]
    with (
        LocalEngine(model, eos_token_ids=()) as on,
        LocalEngine(model, eos_token_ids=(), prefix_cache_tokens=0) as off,
    ):
        outs = await asyncio.gather(*(on.generate(prompt, p) for p in params))
        # Once 29 ids (the shared prefix), then each row its own last prompt id: 29 + 8.
        assert (on.stats["prefill_tokens"], on.stats["cached_tokens"]) == (29 + 8, 8 * 29)
        assert on.stats["max_rows"] == 8
        plain = await asyncio.gather(*(off.generate(prompt, p) for p in params))
        assert (off.stats["prefill_tokens"], off.stats["cached_tokens"]) == (8 * 30, 0)
    for out, ref in zip(outs, plain, strict=True):
        assert_matches_fresh_forward(model, prompt, out, 1.0)
        assert out.token_ids == ref.token_ids  # same seeds, same samples with the cache off
    assert len({tuple(o.token_ids) for o in outs}) > 1  # distinct seeds really sampled apart


async def test_groups_sharing_a_system_prompt_prefill_it_once(model, engine):
    """Like the calculator env: two groups of 8 whose prompts differ only in a short question."""
    system = list(range(100, 120))  # 20 ids shared by both tasks
    prompts = [system + list(range(200, 206))] * 8 + [system + list(range(250, 256))] * 8  # 26
    outs = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(max_new_tokens=8, seed=i))
            for i, p in enumerate(prompts)
        )
    )
    # The system prompt once (20); each group's next 5 ids once (worth it: 7 copies x 5 ids
    # saved >= 32); then each row its last id.
    assert engine.stats["prefill_tokens"] == 20 + 2 * 5 + 16
    assert engine.stats["prefill_tokens"] + engine.stats["cached_tokens"] == 20 + 2 * 25 + 16 * 26
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_fresh_forward(model, prompt, out, 1.0)


async def test_the_next_turn_prefills_only_the_last_sampled_id_and_the_suffix(model, engine):
    history = list(range(40, 60))  # 20 ids
    for turn in range(3):
        before = dict(engine.stats)
        out = await engine.generate(history, SamplingParams(max_new_tokens=8, seed=turn))
        assert_matches_fresh_forward(model, history, out, 1.0)
        if turn == 0:
            assert prefill_delta(engine, before) == (20, 0)
        else:  # the cache held prompt + sampled ids of the last turn, all but the last sampled id
            assert prefill_delta(engine, before) == (1 + 4, len(history) - 5)
        history = history + out.token_ids + [7, 8, 9, 10]  # the env's suffix
    assert len(history) == 20 + 3 * 12 and len(engine.prefix_cache) == 1  # superseded turns left


async def test_partial_and_mixed_prefix_hits_in_one_prefill(model, engine):
    """Rows reusing different lengths (a full hit, a partial hit, none) share one prefill forward
    and join a running row; each still matches its own fresh forward."""
    cached = list(range(3, 33))
    await engine.generate(cached, SamplingParams(max_new_tokens=1))
    assert engine.prefix_cache.keys() == [tuple(cached)]
    running = asyncio.create_task(engine.generate([5, 6], SamplingParams(max_new_tokens=40)))
    while engine.stats["steps"] < 2:
        await asyncio.sleep(0.001)
    prompts = [cached[:12] + list(range(200, 216)), cached + [50], list(range(250, 261))]
    before = dict(engine.stats)
    outs = await asyncio.gather(
        *(engine.generate(p, SamplingParams(max_new_tokens=10)) for p in prompts)
    )
    fed, reused = prefill_delta(engine, before)
    assert engine.stats["prefills"] - before["prefills"] == 1
    assert fed + reused == sum(len(p) for p in prompts) and reused >= 12
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_fresh_forward(model, prompt, out, 1.0)
    assert_matches_fresh_forward(model, [5, 6], await running, 1.0)


async def test_evicted_prefixes_are_prefilled_again(model):
    a, b = list(range(3, 33)), list(range(100, 130))
    with LocalEngine(model, eos_token_ids=(), prefix_cache_tokens=40) as eng:
        await eng.generate(a, SamplingParams(max_new_tokens=5))  # holds a + 4 sampled ids
        await eng.generate(b, SamplingParams(max_new_tokens=5))  # 34 + 34 > 40: a is evicted
        assert [k[:30] for k in eng.prefix_cache.keys()] == [tuple(b)]
        assert eng.prefix_cache.tokens <= 40
        before = dict(eng.stats)
        out = await eng.generate(a, SamplingParams(max_new_tokens=5))
        assert prefill_delta(eng, before) == (30, 0)
        before = dict(eng.stats)
        again = await eng.generate(a, SamplingParams(max_new_tokens=5))
        assert prefill_delta(eng, before) == (1, 29)
    assert_matches_fresh_forward(model, a, out, 1.0)
    assert_matches_fresh_forward(model, a, again, 1.0)


async def test_release_memory_empties_the_prefix_cache(model):
    a = list(range(3, 33))
    with LocalEngine(model, eos_token_ids=()) as eng:
        await eng.generate(a, SamplingParams(max_new_tokens=5))
        assert eng.prefix_cache.tokens == 34
        await eng.release_memory()  # the loop's hook while the learner trains
        assert len(eng.prefix_cache) == 0 and eng.prefix_cache.tokens == 0
        before = dict(eng.stats)
        out = await eng.generate(a, SamplingParams(max_new_tokens=5))
        assert prefill_delta(eng, before) == (30, 0)  # nothing reused: prefilled afresh
    assert_matches_fresh_forward(model, a, out, 1.0)


async def test_prefix_cache_disabled(model):
    prompt = list(range(3, 33))
    with LocalEngine(model, eos_token_ids=(), prefix_cache_tokens=0) as eng:
        outs = await asyncio.gather(
            *(eng.generate(prompt, SamplingParams(max_new_tokens=6)) for _ in range(3))
        )
        turn2 = prompt + outs[0].token_ids + [7, 8]
        out2 = await eng.generate(turn2, SamplingParams(max_new_tokens=6))
        assert eng.stats["cached_tokens"] == 0 and len(eng.prefix_cache) == 0
        assert eng.stats["prefill_tokens"] == 3 * 30 + len(turn2)
    for out in outs:
        assert_matches_fresh_forward(model, prompt, out, 1.0)
    assert_matches_fresh_forward(model, turn2, out2, 1.0)


async def test_update_weights_empties_the_prefix_cache(model):
    """KV cached under old weights is wrong under new ones: reusing it would break this test."""
    prompt = list(range(3, 33))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    new_model = tiny_model(seed=1)
    with LocalEngine(model, eos_token_ids=()) as eng:
        first = await eng.generate(prompt, greedy)
        assert len(eng.prefix_cache) == 1
        await eng.update_weights(new_model.state_dict(), version="v1")
        assert len(eng.prefix_cache) == 0
        before = dict(eng.stats)
        after = await eng.generate(prompt + first.token_ids, greedy)
        assert prefill_delta(eng, before) == (36, 0)
    assert_matches_fresh_forward(new_model, prompt + first.token_ids, after, 0.0)


async def test_smollm2_group_and_next_turn_with_the_prefix_cache(smollm2):
    """The real model and chat template: a group of 4, then one member's second turn."""
    with LocalEngine(smollm2.model, tokenizer=smollm2.tokenizer) as eng:  # an empty prefix cache
        await _smollm2_group_and_next_turn(eng)


async def _smollm2_group_and_next_turn(smollm2):
    tok = smollm2.tokenizer
    system = {"role": "system", "content": "You are a careful assistant. Answer in one word."}
    prompt = tok.apply_chat_template(
        [system, {"role": "user", "content": "What colour is the sky?"}], add_generation_prompt=True
    )["input_ids"]
    before = dict(smollm2.stats)
    outs = await asyncio.gather(
        *(smollm2.generate(prompt, SamplingParams(max_new_tokens=6, seed=i)) for i in range(4))
    )
    assert prefill_delta(smollm2, before) == (len(prompt) - 1 + 4, 4 * (len(prompt) - 1))
    for out in outs:
        assert_matches_fresh_forward(smollm2.model, prompt, out, 1.0)
    suffix = tok("<|im_end|>\n<|im_start|>user\nAnd at night?<|im_end|>\n<|im_start|>assistant\n")[
        "input_ids"
    ]
    turn2 = prompt + outs[0].token_ids + suffix
    before = dict(smollm2.stats)
    out2 = await smollm2.generate(turn2, SamplingParams(max_new_tokens=6))
    assert prefill_delta(smollm2, before) == (1 + len(suffix), len(turn2) - 1 - len(suffix))
    assert_matches_fresh_forward(smollm2.model, turn2, out2, 1.0)


_EXIT_MID_DECODE = """
import asyncio, threading, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from agentgrpo.engine import LocalEngine, SamplingParams
torch.manual_seed(0)
config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=128, max_position_embeddings=4096)
engine = LocalEngine(LlamaForCausalLM(config).eval(), eos_token_ids=())
def decode():  # a caller still waiting when the script ends
    asyncio.run(engine.generate(list(range(1, 9)), SamplingParams(max_new_tokens=4000)))
threading.Thread(target=decode, daemon=True).start()
while engine.stats["steps"] < 3:
    time.sleep(0.01)
print("exiting mid-decode")
"""


def test_a_script_that_ends_while_the_engine_decodes_exits_with_its_own_status():
    """The worker is a daemon thread; left inside a torch call when finalization began, CPython 3.11
    ended it with pthread_exit and the process aborted (SIGABRT, "terminate called without an active
    exception", pytorch#38228) instead of exiting 0: 4 runs out of 4 before the engine closed itself
    at exit."""
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _EXIT_MID_DECODE], capture_output=True, text=True, timeout=120
        )
        assert (proc.returncode, proc.stdout) == (0, "exiting mid-decode\n"), proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr
