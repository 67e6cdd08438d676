"""The records the training step makes from trajectories, joined to them by id: `Score` (the
reward), `Advantage`, and `TrainingRow` (what the loss reads)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentgrpo.types.records import _TOKENS, FrozenDict, _set


@dataclass(frozen=True)
class Score:
    """What a trajectory's reward is, made once its group has been scored: the env's own reward,
    or its rubric's (`agentgrpo.env.rubric.score_group`). Joined to its trajectory by id.

    `reward` is NaN when the trajectory cannot be scored (an infrastructure failure, a verifier
    that failed): it is then left out of its group's statistics and trained on by no row.
    """

    trajectory_id: str
    reward: float
    parts: Mapping[str, float] = field(default_factory=FrozenDict)  # each verifier's score
    detail: str = ""  # the rubric's notes: errors, verifier details, why it is unscorable
    env_reward: float | None = None  # the env's own reward, when a rubric replaced it
    # what verifiers recorded about their judgement, by verifier name, as JSON values (an LLM
    # judge's prompt and answer: agentgrpo.verify.judge)
    info: Mapping[str, Any] = field(default_factory=FrozenDict)

    def __post_init__(self) -> None:
        _set(
            self,
            reward=float(self.reward),
            parts=FrozenDict(self.parts),
            info=FrozenDict(self.info),
        )

    @property
    def unscorable(self) -> bool:
        return math.isnan(self.reward)


@dataclass(frozen=True)
class Advantage:
    """How much better than its group a trajectory did: what the training step gives it
    (`agentgrpo.run.train.assign_advantages`), joined to it by id. A trajectory not trained on
    (unscorable, or cut and masked) has none.

    `value` weighs every sampled token; under a turn-level estimator `per_turn` holds one
    advantage per sampled turn (the k-th run of loss_mask == 1 across the segments in order),
    used for that turn's tokens instead, and `value` is the outcome term.
    """

    trajectory_id: str
    value: float
    per_turn: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        per_turn = None if self.per_turn is None else tuple(float(a) for a in self.per_turn)
        _set(self, value=float(self.value), per_turn=per_turn)
        if not all(math.isfinite(a) for a in (self.value, *(per_turn or ()))):
            raise ValueError(
                f"trajectory {self.trajectory_id!r}: advantages must be finite, got "
                f"{self.value} / {per_turn}: a trajectory not trained on has no Advantage"
            )

    def turn_list(self) -> list[float] | None:
        return None if self.per_turn is None else list(self.per_turn)


@dataclass(frozen=True)
class TrainingRow:
    """One sequence the learner trains on: a segment of a trajectory that holds a sampled token,
    with what the loss needs. `logprobs` are the rollout's (pi_old unless the learner recomputes
    them), 0 off the mask; `token_advantages`, when set, weigh each token (a turn-level
    estimator), else `advantage` weighs every loss token. Checked when made: equal lengths, a mask
    of 0/1 with at least one 1 and none at position 0 (nothing predicts it), finite advantages.
    """

    trajectory_id: str
    group_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    advantage: float
    token_advantages: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        per_token = self.token_advantages
        _set(
            self,
            *_TOKENS,
            advantage=float(self.advantage),
            token_advantages=None if per_token is None else tuple(per_token),
        )
        n, name = len(self.token_ids), f"training row of {self.trajectory_id!r}"
        lengths = {n, len(self.loss_mask), len(self.logprobs)}
        if per_token is not None:
            lengths.add(len(per_token))
        if len(lengths) > 1:
            raise ValueError(
                f"{name}: token_ids/loss_mask/logprobs/token_advantages lengths differ"
            )
        if not set(self.loss_mask) <= {0, 1} or 1 not in self.loss_mask:
            raise ValueError(f"{name}: loss_mask must be 0/1 with at least one loss token")
        if self.loss_mask[0]:
            raise ValueError(f"{name}: token 0 carries loss but nothing predicts it")
        if not math.isfinite(self.advantage) or not all(map(math.isfinite, per_token or ())):
            raise ValueError(f"{name}: advantages must be finite (a dropped trajectory has no row)")

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)
