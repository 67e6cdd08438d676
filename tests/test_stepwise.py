"""Step-wise trajectories (issue 30, items 1 and 2): each chat template of agentgrpo/chat/templates/
that supports tools is attached to the embedded tokenizer (with the template's own special tokens
added), the audit reports the mode it gets, and a multi-turn tool episode with thinking, run against
a scripted engine, is token-exact segment by segment: every engine request is a prefix of one
segment, the sampled ids follow it, and each segment's prompt is the template's render of the
history before it."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json

import pytest
import torch

from agentgrpo import Env, Message
from agentgrpo.chat.format import ChatFormat, HistoryRewritten, TemplateError
from agentgrpo.checks.template_audit import audit
from agentgrpo.checks.template_conversations import SYNTHETIC_TOOL
from agentgrpo.engine import SamplingParams
from agentgrpo.rollout.episode import EpisodeLimits, RolloutConfig, run_episode
from agentgrpo.run.config import load_config
from agentgrpo.types import Segment, StopReason, Task, ToolCall, Trajectory
from tests.conftest import shipped_template, template_file
from tests.fakes import ScriptedEngine

TOOL = SYNTHETIC_TOOL  # the calculator schema the template audit also uses
TASK = Task(id="t", prompt="What is 12 * 7 + 3?", answer="87")

# template -> (end-of-turn token, tokens it needs as special tokens,
#              audit mode under trajectory_mode single, auto, stepwise)
TEMPLATES = {
    "qwen2_5.jinja": ("<|im_end|>", [], ("exact", "exact", "stepwise")),
    "qwen3.jinja": ("<|im_end|>", [], ("refuse", "stepwise", "stepwise")),
    "qwen3_instruct_2507.jinja": ("<|im_end|>", [], ("exact", "exact", "stepwise")),
    "qwen3_5_think.jinja": ("<|im_end|>", [], ("refuse", "stepwise", "stepwise")),
    "qwen3_6.jinja": ("<|im_end|>", [], ("refuse", "stepwise", "stepwise")),
    "nemotron_3_nano.jinja": ("<|im_end|>", [], ("refuse", "stepwise", "stepwise")),
    "lfm2_2_5.jinja": (
        "<|im_end|>",
        ["<|tool_call_start|>", "<|tool_call_end|>"],
        ("refuse", "stepwise", "stepwise"),
    ),
    "llama3_1.jinja": (
        "<|eot_id|>",
        ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<|eom_id|>"],
        ("exact", "exact", "stepwise"),
    ),
    # GPT-OSS ends a turn with <|call|> after a call, <|return|> after an answer (<|end|> ends a
    # message inside the turn, e.g. the analysis before the call); an answer's <|return|> is
    # rendered <|end|> once more messages follow, and a call's analysis is dropped once an answer
    # follows: step-wise (test_gpt_oss_...)
    "gptoss.jinja": (
        ["<|call|>", "<|return|>"],
        [
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ],
        ("refuse", "stepwise", "stepwise"),
    ),
    # GLM-4.5's turn has no end token: it ends where the next role token starts, which is the stop
    # token; the earlier turns' reasoning is dropped after a user message: step-wise
    "glm4moe.jinja": (
        ["<|observation|>", "<|user|>"],
        ["<|user|>", "<|assistant|>", "<|system|>", "<|observation|>", "[gMASK]", "<sop>"],
        ("refuse", "stepwise", "stepwise"),
    ),
    # DeepSeek-V3's template takes tool-call arguments as a JSON string (given so: ChatFormat
    # finds it by a probe) and is token-exact as one sequence, but it never shows the tools to the
    # model (it ignores `tools`): refused for that alone (test_deepseek_v3_...)
    "deepseekv3.jinja": (
        "<｜end▁of▁sentence｜>",
        ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"],
        ("refuse", "refuse", "refuse"),
    ),
    # the tool template SGLang publishes for DeepSeek-V3 (shipped as deepseekv3_tools) lists the
    # tools in the system message and keeps history verbatim: one exact sequence
    "deepseekv3_tools.jinja": (
        "<｜end▁of▁sentence｜>",
        ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"],
        ("exact", "exact", "stepwise"),
    ),
}


@pytest.fixture(scope="module")
def tok(smol_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_path)


class RecordingEngine(ScriptedEngine):
    """The scripted engine, keeping what it returned."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.outs = []

    async def generate(self, prompt_ids, params):
        out = await super().generate(prompt_ids, params)
        self.outs.append(out)
        return out


def _chat(tok, name: str, mode: str, **kw) -> ChatFormat:
    """The template's ChatFormat on the embedded tokenizer with its special tokens; the end-of-turn
    tokens are the ones ChatFormat detects (test_the_end_of_turn_tokens_are_detected...)."""
    _, specials, _ = TEMPLATES[name]
    t = copy.deepcopy(tok)
    if specials:
        t.add_special_tokens({"additional_special_tokens": specials})
    return ChatFormat(t, template=shipped_template(name), trajectory_mode=mode, **kw)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_end_of_turn_tokens_are_detected_from_the_template(tok, name):
    """No `model.end_of_turn` needed: probe renders of the template find the tokens that end an
    assistant turn, GPT-OSS's `<|call|>` after a call and `<|return|>` after an answer, GLM-4.5's
    `<|observation|>` and `<|user|>` (the role token that opens the next message); every other
    test here runs on the detected tokens. A token given still overrides them."""
    eot = TEMPLATES[name][0]
    chat = _chat(tok, name, "auto")
    assert chat.end_of_turns == ((eot,) if isinstance(eot, str) else tuple(eot))
    assert set(chat.end_of_turn_ids) <= set(chat.stop_token_ids)
    given = _chat(tok, name, "auto", end_of_turn=chat.tokenizer.eos_token)
    assert given.end_of_turns == (chat.tokenizer.eos_token,)


class Thinker(Env):
    """Turn 1: the model calls the calculator and gets 84; turn 2: a user asks again (a new query,
    after which thinking templates drop the earlier reasoning); turn 3 ends the episode."""

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return super().reset(seed=seed, options=options)

    def tool_schemas(self):
        return [TOOL]

    def step(self, action: Message):
        self.turn += 1
        if action.tool_calls:
            return (
                [
                    Message(role="tool", content="84", tool_call_id=c.id, name=c.name)
                    for c in action.tool_calls
                ],
                0.0,
                False,
                False,
                {},
            )
        if self.turn == 2:
            return [Message(role="user", content="Are you sure? Add the 3.")], 0.0, False, False, {}
        return [], 1.0, True, False, {}


def _turns() -> list[Message]:
    call = ToolCall(id="call_0", name="calculator", arguments={"expression": "12*7"})
    return [
        Message(
            role="assistant", content="<think>\nThe product first.\n</think>\n\n", tool_calls=[call]
        ),
        Message(role="assistant", content="<think>\n84 + 3 = 87.\n</think>\n\n84 + 3 = 87."),
        Message(role="assistant", content="<think>\nChecked.\n</think>\n\nYes, 87."),
    ]


def _script(chat: ChatFormat):
    """The engine answers with the template's own text for the next scripted assistant turn (the
    render of the history with it, after the generation prompt, up to the first end-of-turn token),
    so every parser reads it. Where the template renders the earlier turns anew once the turn
    follows them (GPT-OSS drops a call's analysis once an answer follows), the turn is cut from its
    render right after the task's messages. GLM's turn has no end token: the model stops on the
    role token of what follows, <|observation|> after a call, <|user|> after an answer."""
    env_turns = [
        [Message(role="tool", content="84", tool_call_id="call_0", name="calculator")],
        [Message(role="user", content="Are you sure? Add the 3.")],
    ]
    texts, history = [], TASK.prompt_messages()
    for k, a in enumerate(_turns()):
        gen = chat.render(history, [TOOL], add_generation_prompt=True)
        full = chat.render(history + [a], [TOOL])
        if not full.startswith(gen):
            alone = TASK.prompt_messages()
            gen_alone = chat.render(alone, [TOOL], add_generation_prompt=True)
            if chat.render(alone + [a], [TOOL]).startswith(gen_alone):
                gen, full = gen_alone, chat.render(alone + [a], [TOOL])
        start = next(
            (i for i, (x, y) in enumerate(zip(gen, full, strict=False)) if x != y), len(gen)
        )
        text = full[start:]
        if chat.turn_end_opens_next:
            texts.append(text + ("<|observation|>" if a.tool_calls else "<|user|>"))
        else:
            end = min(text.index(e) + len(e) for e in chat.end_of_turns if e in text)
            texts.append(text[:end])
        history += [a] + (env_turns[k] if k < len(env_turns) else [])
    return lambda ids, i: texts[i]


def check_token_exact(traj: Trajectory, engine: RecordingEngine, chat: ChatFormat) -> None:
    """Segment by segment: engine request k is the prefix of one segment up to its k-th sampled run,
    the run holds the ids it sampled with its logprobs, and a segment's prompt is `prompt_ids` of
    the messages before its first sampled turn."""
    runs = []  # (segment, start, end) of every sampled run, in order
    for s, seg in enumerate(traj.segments):
        m = seg.loss_mask
        runs += [
            (s, i, next((j for j in range(i, len(m)) if not m[j]), len(m)))
            for i in range(len(m))
            if m[i] and (i == 0 or not m[i - 1])
        ]
    assert len(runs) == len(engine.calls) == traj.num_turns
    for k, (s, start, end) in enumerate(runs):
        seg = traj.segments[s]
        assert list(seg.token_ids[:start]) == engine.calls[k]  # what the engine received, exactly
        assert list(seg.token_ids[start:end]) == engine.outs[k].token_ids  # what it sampled
        assert list(seg.logprobs[start:end]) == engine.outs[k].logprobs
    check_segment_prompts(traj, chat, [TOOL])


def check_segment_prompts(
    traj: Trajectory, chat: ChatFormat, tools: list[dict] | None, max_tool_calls: int | None = None
) -> None:
    """What can be checked without the engine: every segment holds the invariant, its sampled runs
    are turns in order, and its prompt is the template's render of the messages before its first
    turn (the first segment's: the env's first messages)."""
    traj.check()
    # the sampled turns are the last num_turns assistant messages (the env's first messages may
    # hold a worked example)
    assistants = [i for i, msg in enumerate(traj.messages) if msg.role == "assistant"]
    assistants = assistants[len(assistants) - traj.num_turns :]
    turn = 0
    for seg in traj.segments:
        m = seg.loss_mask
        starts = [i for i in range(len(m)) if m[i] and (i == 0 or not m[i - 1])]
        assert starts and starts[0] == seg.prompt_len
        assert list(seg.token_ids[: seg.prompt_len]) == chat.prompt_ids(
            traj.messages[: assistants[turn]], tools, max_tool_calls=max_tool_calls
        )
        turn += len(starts)
    assert turn == traj.num_turns


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_tool_template_gets_its_mode_and_token_exact_segments(tok, name):
    modes = dict(zip(("single", "auto", "stepwise"), TEMPLATES[name][2], strict=True))
    for mode, want in modes.items():
        report = audit(_chat(tok, name, mode, template_kwargs={"enable_thinking": True}))
        assert report.mode == want, (mode, report.format())
        if want != "refuse":
            assert report.trajectory_mode == mode and (want == "stepwise") == (
                report.new_segments > 0
            )
        elif mode != "single":  # refused for what segments do not mend: the turn's end, the render
            fatal = {i.kind for i in report.issues if i.fatal}
            assert fatal and fatal <= {"no_end_of_turn", "render_error", "no_tool_support"}, fatal
    for mode, want in modes.items():
        if want == "refuse":
            continue
        chat = _chat(tok, name, mode, template_kwargs={"enable_thinking": True})
        traj, engine = _run(chat)
        assert traj.stop_reason == StopReason.COMPLETED and traj.num_turns == 3, traj.stop_detail
        assert [c.name for c in traj.messages[1].tool_calls or []] == ["calculator"]
        check_token_exact(traj, engine, chat)
        assert len(traj.segments) == {"exact": 1, "stepwise": 3 if mode == "stepwise" else 2}[want]
        if want == "stepwise" and mode == "auto":  # the user's new query rewrote the history
            assert [s.num_sampled > 0 for s in traj.segments] == [True, True]


def test_qwen3_6_thinking_trains_without_fallback_in_auto_mode_and_is_refused_in_single(tok):
    """The reasoning of turn 1 is sampled and trained in turn 1's segment; after the user's new
    query the template drops it, and the next segment's prompt is that rewritten history."""
    single = _chat(tok, "qwen3_6.jinja", "single", template_kwargs={"enable_thinking": True})
    traj, engine = _run(single)
    assert traj.stop_reason == StopReason.ENV_ERROR and "not prefix-preserving" in traj.stop_detail
    assert "trajectory_mode=auto" in traj.stop_detail
    chat = _chat(tok, "qwen3_6.jinja", "auto", template_kwargs={"enable_thinking": True})
    traj, engine = _run(chat)
    first, second = traj.segments
    sampled = [
        chat.decode([t for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m])
        for s in (first, second)
    ]
    assert "The product first." in sampled[0] and "84 + 3 = 87." in sampled[0]
    assert "Checked." in sampled[1]
    second_prompt = chat.decode(second.token_ids[: second.prompt_len])
    assert "The product first." not in second_prompt and "84 + 3 = 87." in second_prompt
    assert traj.reward == 1.0 and traj.num_sampled == first.num_sampled + second.num_sampled
    row = json.loads(json.dumps(traj.to_dict()))
    assert tuple(Segment.from_dict(s) for s in row["segments"]) == traj.segments
    assert row["token_ids"] == list(second.token_ids)  # the flat fields are the last segment
    # the template's own switch keeps the reasoning in history: auto is then one sequence
    keep = _chat(
        tok,
        "qwen3_6.jinja",
        "auto",
        template_kwargs={"enable_thinking": True, "preserve_thinking": True},
    )
    assert audit(keep).mode == "exact"


def test_history_rewritten_is_a_template_error_and_keep_history_excludes_segments(tok):
    assert issubclass(HistoryRewritten, TemplateError)
    with pytest.raises(ValueError, match="choose one"):
        _chat(tok, "qwen3.jinja", "auto", fallback="keep_history")
    with pytest.raises(ValueError, match="choose one"):
        RolloutConfig(template_fallback="keep_history", trajectory_mode="stepwise")
    with pytest.raises(ValueError, match="trajectory_mode must be one of"):
        _chat(tok, "qwen3.jinja", "sometimes")


def test_a_segment_opened_but_never_sampled_is_dropped_and_the_budget_spans_segments(tok):
    """max_tokens counts the tokens after each segment's prompt, over all segments: the episode
    ends when they are spent, and a segment whose turn never came is not kept."""
    chat = _chat(tok, "qwen3_6.jinja", "stepwise", template_kwargs={"enable_thinking": True})
    script = _script(chat)
    first = len(chat.encode(script([], 0)))  # the first turn's sampled ids (with the end of turn)
    traj, engine = _run(chat, script, max_tokens=first)
    assert traj.stop_reason == StopReason.MAX_TOKENS and len(engine.calls) == 1
    assert len(traj.segments) == 1 and traj.num_sampled == first
    traj.check()


def test_the_learner_trains_a_row_per_segment_with_the_episode_s_advantage():
    from agentgrpo.learner.batch import make_micro_batches
    from tests.tiny import rows as training_rows
    from tests.tiny import traj

    one = traj([1, 2, 3, 4, 5], [0, 0, 1, 1, 0], group="g")
    two = dataclasses.replace(
        traj([1, 2, 6, 7], [0, 0, 1, 1], group="g"),
        earlier_segments=[
            Segment([1, 2, 8], [0, 0, 1], [0.0, 0.0, -1.0], 2),
            Segment([1, 2, 9, 9], [0, 0, 0, 0], [0.0] * 4, 2),  # nothing sampled
        ],
    )
    rows = training_rows([one, two], [0.5, -1.0])
    assert [r.token_ids for r in rows] == [(1, 2, 3, 4, 5), (1, 2, 8), (1, 2, 6, 7)]
    advs = [r.advantage for r in rows]
    assert advs == [0.5, -1.0, -1.0] and all(r.group_id == "g" for r in rows)
    assert [r.trajectory_id for r in rows] == [one.id, two.id, two.id]
    (mb,) = make_micro_batches(rows, 64, mode="shared_prefix")
    assert mb.advantages_B.tolist() == [advs[r] for r in mb.rows] and sorted(mb.rows) == [0, 1, 2]
    assert mb.loss_mask_BT.sum() == 5
    assert mb.num_real_tokens == 2 + 3 + 1 + 2  # the prefix [1, 2] once, each segment's own tokens


def test_the_report_s_trajectory_viewer_shows_every_segment():
    from agentgrpo.run.report import _traj_html
    from tests.tiny import traj

    t = dataclasses.replace(
        traj([1, 2, 6, 7], [0, 0, 1, 1]),
        earlier_segments=[Segment([1, 2, 8], [0, 0, 1], [0.0, 0.0, -1.0], 2)],
    )
    page = _traj_html(t.to_dict(), {8: "eight", 6: "six"}, 100)
    assert (
        "segment 1 of 2, tokens: 3 (1 generated)" in page
        and "segment 2 of 2, tokens: 4 (2 generated)" in page
    )
    assert page.index("eight") < page.index("six")
    single = _traj_html(traj([1, 2, 6], [0, 0, 1]).to_dict(), {}, 100)
    assert "segment" not in single and "tokens: 3 (1 generated)" in single


def rows_as_trajectories(path) -> list[Trajectory]:
    from agentgrpo.run.log import read_jsonl

    out = []
    for r in read_jsonl(path):
        t = Trajectory(
            task_id=r["task_id"],
            token_ids=r["token_ids"],
            loss_mask=r["loss_mask"],
            logprobs=r["logprobs"],
            prompt_len=r["prompt_len"],
            messages=[Message.from_dict(m) for m in r["messages"]],
            stop_reason=StopReason(r["stop_reason"]),
            num_turns=r["num_turns"],
        )
        if "segments" in r:
            *earlier, last = [Segment.from_dict(s) for s in r["segments"]]
            assert last == t.segments[-1]  # the flat fields are the last segment
            t = dataclasses.replace(t, earlier_segments=earlier)
        out.append(t)
    return out


@pytest.mark.slow
def test_calculator_trains_stepwise_with_qwen3_6_and_thinking_on_the_embedded_model(
    tmp_path, smol_path
):
    """Issue 30's check: two CPU steps of the calculator env with the Qwen3.6 template attached to
    the embedded model and thinking on, step-wise, no fallback; every trajectory passes the checks
    segment by segment."""
    from transformers import AutoTokenizer

    from agentgrpo.cli import main
    from agentgrpo.run.log import read_jsonl
    from envs.calculator import CalculatorEnv

    template = shipped_template("qwen3_6.jinja")
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "examples/calculator.yaml",
            "train.steps=2",
            f"output_dir={out}",
            "model.chat_template=qwen3_6",  # a shipped template by name
            "rollout.chat_template_kwargs={enable_thinking: true}",
            "rollout.trajectory_mode=stepwise",
            "log.progress=false",
        ]
    )
    assert rc == 0
    chat = ChatFormat(
        AutoTokenizer.from_pretrained(smol_path),
        template=template,
        template_kwargs={"enable_thinking": True},
        trajectory_mode="stepwise",
    )
    env = CalculatorEnv()
    trajs = rows_as_trajectories(out / "trajectories.jsonl")
    rollout = load_config("examples/calculator.yaml").rollout
    assert len(trajs) == 2 * rollout.tasks_per_step * rollout.group_size
    assert all(t.stop_reason != StopReason.ENV_ERROR for t in trajs)
    for t in trajs:
        if t.num_sampled:
            check_segment_prompts(t, chat, env.tool_schemas(), env.max_tool_calls_per_turn)
    assert all(len(t.segments) == t.num_turns for t in trajs if t.num_sampled)
    assert all(m["loss"] == m["loss"] for m in read_jsonl(out / "metrics.jsonl"))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_step_wise_episode_trains_exactly_as_its_segments_would_as_trajectories(agg):
    """The learner's step on episodes of two segments gives the gradient of the same segments given
    as separate trajectories with the episode's advantage: a row per segment, under either
    aggregation (docs/learner.md says how that weighs)."""

    from agentgrpo.algo.loss import LossConfig
    from agentgrpo.learner.learner import Learner, LearnerConfig
    from tests.test_learner import TEMPERATURE, batch_and_advantages, record_grads
    from tests.tiny import rows, tiny_llama

    flat, adv = batch_and_advantages()
    flat_adv = list(adv)
    episodes, episode_adv = [], []
    for i in range(0, len(flat), 2):  # members 2k and 2k+1 of a group become one episode
        first, last = flat[i], flat[i + 1]
        episodes.append(dataclasses.replace(last, earlier_segments=[first.segments[0]]))
        episode_adv.append(adv[i])
        flat_adv[i + 1] = adv[i]
    grads = []
    for trajs, advs in ((episodes, episode_adv), (flat, flat_adv)):
        learner = Learner(
            tiny_llama(),
            LearnerConfig(micro_batch_tokens=64, grad_clip=1e9),
            LossConfig(agg=agg),
            temperature=TEMPERATURE,
        )
        got = record_grads(learner)
        metrics = learner.train_step(rows(trajs, advs))
        grads.append(got[0])
    assert metrics["train_tokens"] == sum(len(t.token_ids) for t in flat)
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-6, rtol=1e-4, msg=name)


def _run(
    chat: ChatFormat, script=None, max_tokens: int = EpisodeLimits().max_tokens
) -> tuple[Trajectory, RecordingEngine]:
    engine = RecordingEngine(chat.tokenizer, script or _script(chat), chat.end_of_turn_id)
    limits = EpisodeLimits(max_turns=4, max_tokens=max_tokens)
    traj = asyncio.run(
        run_episode(
            Thinker(), engine, chat, TASK, SamplingParams(max_new_tokens=200), limits=limits
        )
    )
    return traj, engine


def test_gpt_oss_keeps_the_sampled_end_tokens_and_segments_where_the_template_rewrites(tok):
    """The call ends with <|call|> and the answer with <|return|>, each the last sampled id of its
    turn; the tool result continues the call's sequence, and the user's question after the answer
    (rendered with <|end|>, the call's analysis dropped) opens the second segment."""
    chat = _chat(tok, "gptoss.jinja", "auto")
    traj, engine = _run(chat)
    call, ret = chat.end_of_turn_ids
    assert [out.token_ids[-1] for out in engine.outs] == [call, ret, ret]
    first, second = traj.segments
    assert chat.decode(first.token_ids).count("<|call|>") == 1
    assert chat.decode(first.token_ids).endswith("<|return|>")
    prompt = chat.decode(second.token_ids[: second.prompt_len])
    assert "84 + 3 = 87.<|end|><|start|>user" in prompt and "The product first." not in prompt
    check_token_exact(traj, engine, chat)


def test_glm_stops_on_the_next_role_token_and_a_mismatched_one_opens_a_segment(tok):
    """The model's stop token is the first token of what follows; a call stopped on <|user|>
    (the template opens tool results with <|observation|>) cannot be continued: a new segment in
    auto mode, the episode's end with the reason in single mode."""
    chat = _chat(tok, "glm4moe.jinja", "auto")
    traj, engine = _run(chat)
    obs, user = chat.end_of_turn_ids
    assert [out.token_ids[-1] for out in engine.outs] == [obs, user, user]
    assert len(traj.segments) == 2 and traj.segments[0].token_ids.count(obs) == 1
    script = _script(chat)

    def stops_on_user(ids, i):
        return script(ids, i).replace("<|observation|>", "<|user|>")

    traj, engine = _run(chat, stops_on_user)
    assert traj.stop_reason == StopReason.COMPLETED and len(traj.segments) == 3
    check_token_exact(traj, engine, chat)
    single = _chat(tok, "glm4moe.jinja", "single")
    traj, _ = _run(single, stops_on_user)
    assert traj.stop_reason == StopReason.ENV_ERROR
    assert "ended its turn with '<|user|>'" in traj.stop_detail


def test_deepseek_v3_is_refused_only_because_its_template_never_shows_the_tools(tok):
    """With the arguments rendered as JSON text (the probe finds that the template wants a
    string), every tool conversation renders and continues as one exact sequence; what remains is
    that the template ignores `tools`, so the model would be trained to call tools it is never
    shown: refused in every mode for that alone. Without tools it is exact."""
    for mode in ("single", "auto", "stepwise"):
        chat = _chat(tok, "deepseekv3.jinja", mode)
        report = audit(chat)
        assert {i.kind for i in report.issues if i.fatal} == {"no_tool_support"}, report.format()
        assert not [i for i in report.issues if i.kind in ("render_error", "parser_mismatch")]
        assert "model.chat_template: deepseekv3_tools" in report.format()  # what to do
    assert chat.string_arguments
    assert audit(_chat(tok, "deepseekv3.jinja", "auto"), tools=[]).mode == "exact"
    chat = _chat(tok, "deepseekv3.jinja", "auto")
    traj, engine = _run(chat)  # the rollout itself, which the audit would not let start
    assert traj.stop_reason == StopReason.COMPLETED and len(traj.segments) == 1
    assert [(c.name, c.arguments) for c in traj.messages[1].tool_calls] == [
        ("calculator", {"expression": "12*7"})
    ]
    check_token_exact(traj, engine, chat)


def test_the_run_config_passes_its_end_of_turn_tokens(tok):
    from agentgrpo.run.config import RunConfig

    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": TEMPLATES["gptoss.jinja"][1]})
    config = RunConfig.model_validate(
        {
            "model": {
                "chat_template": str(template_file("gptoss.jinja")),
                "end_of_turn": ["<|call|>", "<|return|>"],
            }
        }
    )
    chat = config.chat_format(t)
    assert chat.end_of_turns == ("<|call|>", "<|return|>") and chat.parser_name == "harmony"
    assert RunConfig().chat_format(tok).end_of_turns == (tok.eos_token,)
    # left out, they are detected from the template; given, they override it
    detected = RunConfig.model_validate({"model": {"chat_template": "gptoss"}}).chat_format(t)
    assert detected.end_of_turns == ("<|call|>", "<|return|>")
    config.model.end_of_turn = ["<|return|>"]
    assert config.chat_format(t).end_of_turns == ("<|return|>",)


def test_segment_rows_give_each_segment_its_own_turns_advantages():
    from agentgrpo.learner.batch import make_micro_batches
    from tests.tiny import rows as training_rows
    from tests.tiny import traj

    # turns: segment 0 holds turn 0 ([8]), segment 1 nothing, the last segment turns 1 and 2
    t = dataclasses.replace(
        traj([1, 2, 6, 5, 7], [0, 0, 1, 0, 1], group="g"),
        earlier_segments=[
            Segment([1, 2, 8], [0, 0, 1], [0.0, 0.0, -1.0], 2),
            Segment([1, 2, 9, 9], [0, 0, 0, 0], [0.0] * 4, 2),
        ],
    )
    assert t.sampled_turn_rewards() == [0.0, 0.0, 0.0]  # no env.step answered any of them
    rows = training_rows([t], [1.0], [[0.25, -0.5, 2.0]])
    assert [r.token_advantages for r in rows] == [(0, 0, 0.25), (0, 0, -0.5, 0, 2.0)]
    assert [r.advantage for r in rows] == [1.0, 1.0]
    (mb,) = make_micro_batches(rows, 64)
    adv_BT = mb.token_advantages_BT
    got = {tuple(rows[i].token_ids): adv_BT[n].tolist() for n, i in enumerate(mb.rows)}
    # loss layout: from each row's first to its last loss token; 0 where the loss ignores a token
    assert got == {(1, 2, 8): [0.25, 0.0, 0.0], (1, 2, 6, 5, 7): [-0.5, 0.0, 2.0]}


def test_the_report_s_trajectory_viewer_shows_turn_advantages():
    from agentgrpo.run.report import _traj_html
    from agentgrpo.types import Advantage
    from tests.tiny import traj

    t = dataclasses.replace(traj([1, 2, 6, 5, 7], [0, 0, 1, 0, 1]), turn_rewards=[0.5, 1.0])
    page = _traj_html(t.to_dict(advantage=Advantage(t.id, 0.0, (1.25, -0.5))), {}, 100)
    assert "turn rewards 0.5, 1" in page and "turn advantages 1.25, -0.5" in page
    assert "turn advantages" not in _traj_html(traj([1, 2, 6], [0, 0, 1]).to_dict(), {}, 100)


@pytest.mark.parametrize("mode", ["single", "auto", "stepwise"])
def test_the_builder_continues_starts_a_segment_or_refuses_as_the_mode_says(tok, mode):
    """The one trajectory builder on Qwen3.6 with thinking: after a tool result the template extends
    the sequence (a suffix, loss mask 0); after a new user query it drops the reasoning, so "auto"
    starts a segment whose prompt is the re-rendered history, "single" refuses and "stepwise"
    starts one at every turn. Sampled ids keep their logprobs and versions, token for token."""
    from agentgrpo.chat.trajectory import PromptDiverged, TrajectoryBuilder

    chat = _chat(tok, "qwen3_6.jinja", mode, template_kwargs={"enable_thinking": True})
    texts, (a1, a2, _) = _script(chat), _turns()
    tool = [Message(role="tool", content="84", tool_call_id="call_0", name="calculator")]
    user = [Message(role="user", content="Are you sure? Add the 3.")]
    history = TASK.prompt_messages()
    b = TrajectoryBuilder(chat)
    b.open_segment(chat.prompt_ids(history, [TOOL]))
    first = chat.encode(texts([], 0))
    b.sampled(first, [-0.5] * len(first), [(2, "3"), (len(first) - 2, "4")])
    assert b.token_versions == [(2, 3), (len(first) - 2, 4)] and b.weight_versions == (3, 4)
    history.append(a1)
    assert b.continue_with(history, tool, [TOOL]) == (mode == "stepwise")
    history += tool
    assert list(b.token_ids) == chat.prompt_ids(history, [TOOL])  # one piece, or its own prompt
    second = chat.encode(texts([], 1))
    b.sampled(second, [-0.25] * len(second))
    history.append(a2)
    if mode == "single":
        with pytest.raises(HistoryRewritten):
            b.continue_with(history, user, [TOOL])
        with pytest.raises(PromptDiverged, match="first difference at token"):
            b.extend_to(chat.prompt_ids(history + user, [TOOL]))
        assert len(b.segments()) == 1  # nothing was added by either
        return
    assert b.continue_with(history, user, [TOOL])  # the reasoning was dropped: a new segment
    history += user
    assert list(b.token_ids) == chat.prompt_ids(history, [TOOL]) and b.prompt_len == len(
        b.token_ids
    )
    assert len(b.segments()) == {"auto": 1, "stepwise": 2}[mode]  # the new one holds no sample yet
    segments = b.segments()
    for s in segments:
        s.check()
    sampled = [i for s in segments for i, m in zip(s.token_ids, s.loss_mask) if m]
    assert sampled == first + second
    # the budget: tokens after each segment's own prompt (the open one's prompt is not counted)
    assert b.used == sum(len(s.token_ids) - s.prompt_len for s in segments)
    if mode == "stepwise":
        assert b.used == len(first) + len(second)


def test_the_builder_takes_prompts_made_elsewhere_as_the_endpoint_does(tok):
    """extend_to: a prompt that starts with the ids so far extends them (its new ids mask 0);
    another opens a segment; a segment opened but never sampled is left out."""
    from agentgrpo.chat.trajectory import TrajectoryBuilder

    chat = _chat(tok, "qwen2_5.jinja", "auto")
    b = TrajectoryBuilder(chat)
    assert b.extend_to([1, 2, 3]) is False and b.segments()[0].token_ids == (1, 2, 3)
    b.sampled([4, 5], [-1.0, -2.0])
    assert b.extend_to([1, 2, 3, 4, 5, 6]) is False  # extends: 6 is appended with mask 0
    b.sampled([7], [-3.0])
    assert b.segments()[0].loss_mask == (0, 0, 0, 1, 1, 0, 1)
    assert b.extend_to([1, 2, 9]) is True  # diverges at token 2: a new segment
    assert [s.token_ids for s in b.segments()] == [(1, 2, 3, 4, 5, 6, 7)]  # not sampled: left out
    b.sampled([8], [-0.5])
    assert [s.token_ids for s in b.segments()] == [(1, 2, 3, 4, 5, 6, 7), (1, 2, 9, 8)]
    assert b.used == 4 + 1  # tokens after each segment's prompt
    with pytest.raises(ValueError, match="2 sampled ids but 1 logprobs"):
        b.sampled([1, 2], [-1.0])
