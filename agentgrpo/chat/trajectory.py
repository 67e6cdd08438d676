"""The one trajectory builder: rendered turns in, token-exact segments and loss masks out.

Every path that turns a conversation into training tokens goes through `TrajectoryBuilder`: the
rollout's episodes, the calls an agent makes to the episode endpoint (`agents.chat_episode`) and
the template audit's conversations. Its rules:

- sampled ids are appended verbatim with the engine's logprobs and loss mask 1 (`sampled`); every
  other id (prompts, the env's messages, template glue) gets mask 0 and logprob 0;
- after the env's messages the sequence goes on with their suffix (`ChatFormat.suffix_ids`), or,
  where the template renders the history anew, in a new segment whose prompt is that rendering:
  `chat.trajectory_mode` "single" refuses (`HistoryRewritten`), "auto" starts a segment then,
  "stepwise" at every turn (`continue_with`);
- a prompt made elsewhere (an agent's request) extends the sequence when it starts with it, and
  otherwise starts a segment, or under "single" is refused (`extend_to`, `PromptDiverged`).
"""

from __future__ import annotations

from collections.abc import Sequence

from agentgrpo.chat.format import ChatFormat, HistoryRewritten
from agentgrpo.types import Message, Segment


class PromptDiverged(ValueError):
    """Under `trajectory_mode` "single": a prompt that does not extend the ids so far.

    `at` is the first token that differs, `length` the number of ids so far."""

    def __init__(self, at: int, length: int) -> None:
        super().__init__(
            f"the prompt does not extend the previous prompt + completion (first difference at "
            f"token {at} of {length})"
        )
        self.at, self.length = at, length


class TrajectoryBuilder:
    """The token sequences of one episode, built turn by turn.

    `token_ids` / `loss_mask` / `logprobs` / `prompt_len` are the open segment's (what the engine
    continues); `segments()` gives the finished ones. `weight_versions` and `token_versions` say
    which weights sampled the tokens (see `Trajectory.token_versions`).

    Example (two turns; the sampled ids and logprobs stand in for an engine's `Completion`):
        >>> from agentgrpo.chat.format import ChatFormat
        >>> from agentgrpo.chat.trajectory import TrajectoryBuilder
        >>> from agentgrpo.models.embedded import default_model_path, load_tokenizer
        >>> from agentgrpo.types import Message, StopReason, Trajectory
        >>> chat = ChatFormat(load_tokenizer(default_model_path()))
        >>> messages = [Message(role="user", content="Say 7, then 8.")]
        >>> b = TrajectoryBuilder(chat)
        >>> b.open_segment(chat.prompt_ids(messages))
        >>> sampled = chat.encode("7<|im_end|>")  # completion.token_ids
        >>> b.sampled(sampled, [-0.5, -0.1])  # and completion.logprobs
        >>> messages += [chat.parse_assistant(sampled, parse_tools=False).message]
        >>> new = [Message(role="user", content="Now 8.")]
        >>> b.continue_with(messages, new)  # False: the suffix extends this segment
        False
        >>> sampled = chat.encode("8<|im_end|>")
        >>> b.sampled(sampled, [-0.3, -0.1])
        >>> messages += [*new, chat.parse_assistant(sampled, parse_tools=False).message]
        >>> [(s.num_sampled, s.num_turns) for s in b.segments()]
        [(4, 2)]
        >>> trajectory = Trajectory.of_segments(
        ...     b.segments(), task_id="t", messages=messages, stop_reason=StopReason.COMPLETED
        ... )
        >>> print(chat.decode(trajectory.token_ids))
        <|im_start|>user
        Say 7, then 8.<|im_end|>
        <|im_start|>assistant
        7<|im_end|>
        <|im_start|>user
        Now 8.<|im_end|>
        <|im_start|>assistant
        8<|im_end|>
    """

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self.closed: list[Segment] = []
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.prompt_len = 0
        self.spent = 0  # tokens after the prompt in the closed segments
        self.token_versions: list[tuple[int, int]] = []
        self._versions: set[int] = set()

    @property
    def used(self) -> int:
        """Tokens after the prompts, over all segments: what `rollout.max_tokens` bounds (a new
        segment's prompt holds the env's messages again; they count once, where they came)."""
        return self.spent + len(self.token_ids) - self.prompt_len

    @property
    def weight_versions(self) -> tuple[int, ...]:
        return tuple(sorted(self._versions))

    def open_segment(self, prompt_ids: Sequence[int]) -> None:
        """Start a segment whose prompt is `prompt_ids` (the first one, or after the open one,
        which is closed)."""
        if self.token_ids:
            self.spent += len(self.token_ids) - self.prompt_len
            self.closed.append(
                Segment(self.token_ids, self.loss_mask, self.logprobs, self.prompt_len)
            )
        self.token_ids, self.loss_mask, self.logprobs = [], [], []
        self.prompt_len = len(prompt_ids)
        self.append(prompt_ids)

    def append(self, ids: Sequence[int]) -> None:
        """Ids the model did not sample: loss mask 0, logprob 0."""
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def sampled(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        version_runs: Sequence[tuple[int, str | None]] | None = None,
    ) -> None:
        """The model's turn, verbatim: loss mask 1 and its sampling logprobs. `version_runs`:
        (count, weight version) over the ids (`Completion.token_version_runs`); a version that is
        not a number counts as -1."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} logprobs")
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        runs = self.token_versions
        for n, version in version_runs or [(len(ids), None)]:
            v = int(version) if version is not None and version.isdigit() else -1
            if v >= 0:
                self._versions.add(v)
            if runs and runs[-1][1] == v:
                runs[-1] = (runs[-1][0] + n, v)
            else:
                runs.append((n, v))

    def continue_with(
        self,
        history: Sequence[Message],
        new: Sequence[Message],
        tools: list[dict] | None = None,
        *,
        max_tool_calls: int | None = None,
    ) -> bool:
        """Go on after the env's messages `new`; `history` is the conversation so far, ending with
        the assistant turn just sampled. Returns True when a new segment was started (its prompt:
        the template's rendering of `history + new`), False when the suffix was appended.

        Raises `HistoryRewritten` under "single" when the template rewrites history, and what
        the template or tokenizer raise on the messages. `max_tool_calls`: as in `suffix_ids`."""
        chat = self.chat
        if chat.trajectory_mode != "stepwise":
            end_id = self.token_ids[-1] if self.token_ids else None  # the stop id sampled
            try:
                suffix = chat.suffix_ids(
                    history, new, tools, max_tool_calls=max_tool_calls, end_id=end_id
                )
            except HistoryRewritten:
                if chat.trajectory_mode == "single":
                    raise
            else:
                self.append(suffix)
                return False
        self.open_segment(chat.prompt_ids([*history, *new], tools, max_tool_calls=max_tool_calls))
        return True

    def extend_to(self, prompt_ids: Sequence[int]) -> bool:
        """A prompt made elsewhere (an agent's whole request): its ids past the sequence so far
        are appended when it starts with that sequence; otherwise, and for every prompt but the
        first under "stepwise", it opens a new segment. Returns whether it did. Raises
        `PromptDiverged` under "single" for a prompt that does not extend, adding nothing."""
        ids, mode = self.token_ids, self.chat.trajectory_mode
        if ids and mode != "stepwise" and list(prompt_ids[: len(ids)]) == ids:
            self.append(prompt_ids[len(ids) :])
            return False
        if ids and mode == "single":
            at = next(
                (i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b),
                min(len(ids), len(prompt_ids)),
            )
            raise PromptDiverged(at, len(ids))
        self.open_segment(prompt_ids)
        return bool(self.closed)

    def segments(self) -> tuple[Segment, ...]:
        """The segments so far, in order. A segment opened after another and never sampled is
        left out (its prompt alone trains nothing); so is an empty first one."""
        if not self.token_ids or (self.closed and 1 not in self.loss_mask):
            return tuple(self.closed)
        return (
            *self.closed,
            Segment(self.token_ids, self.loss_mask, self.logprobs, self.prompt_len),
        )
