"""Any Gymnasium environment with a discrete action space, played through text.

Each assistant turn is one Gymnasium step: the observation is rendered as a user message, the
action is the last action word of the reply, and the wrapped env's reward is the turn's (the
trajectory's is their sum). The wrapped env's `terminated` / `truncated` end the episode.
FrozenLake, Taxi and Blackjack have their own renderers (`TEXT_SPECS`); any other env gets a
generic one. An invalid reply costs `invalid_penalty` and re-prompts (or ends the episode);
`max_invalid` of them end it as PARSE_ERROR. A task is one start state (env id, `make`
arguments, reset seed), so a group's members start alike. The details: docs/environments.md
("Gymnasium in text").
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium
from gymnasium.envs.toy_text import BlackjackEnv, FrozenLakeEnv, TaxiEnv
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from agentgrpo import Env, EnvStep, Message, StopReason, Task

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ANSI_SPAN = re.compile(r"\x1b\[([0-9;]*)m(.*?)\x1b\[0?m", re.S)  # text in one colour, then a reset
_BACKGROUND = {str(c) for c in (*range(40, 48), *range(100, 108))}  # Gymnasium's `highlight=True`


def plain_ansi(text: str) -> str:
    """An `ansi` render as plain text: a highlighted span becomes `[span]`, other colours go."""

    def span(m: re.Match[str]) -> str:
        return f"[{m.group(2)}]" if _BACKGROUND & set(m.group(1).split(";")) else m.group(2)

    return _ANSI.sub("", _ANSI_SPAN.sub(span, text))


@dataclass(frozen=True)
class TextSpec:
    """How one Gymnasium environment reads as text."""

    rules: Callable[[gymnasium.Env], str]  # shown once, in the system message
    action_words: tuple[str, ...]  # action index -> the word the model says
    render: Callable[[gymnasium.Env, Any], str]  # observation -> text


def _frozen_lake_rules(env: gymnasium.Env) -> str:
    slippery = len(env.unwrapped.P[0][0]) > 1  # a slippery lake has several outcomes per move
    return (
        "You walk on a frozen lake drawn as a grid: S is the start, F frozen ice, H a hole, "
        "G the goal, and X marks where you stand. Reach G without falling into a hole; you "
        "get 1 point at G. Moving off the grid leaves you where you are."
        + (" The ice is slippery: you sometimes slide sideways." if slippery else "")
    )


def _frozen_lake_render(env: gymnasium.Env, obs: Any) -> str:
    desc = env.unwrapped.desc
    ncol = desc.shape[1]
    row, col = divmod(int(obs), ncol)
    lines = []
    for r, cells in enumerate(desc):
        chars = [c.decode() for c in cells]
        if r == row:
            chars[col] = "X"
        lines.append(" ".join(chars))
    return "\n".join(lines) + f"\nYou are at row {row + 1}, column {col + 1}."


_TAXI_STOPS = "RGYB"


def _taxi_render(env: gymnasium.Env, obs: Any) -> str:
    u = env.unwrapped
    taxi_row, taxi_col, passenger, dest = u.decode(int(obs))
    grid = [[c.decode() for c in line] for line in u.desc]
    grid[1 + taxi_row][2 * taxi_col + 1] = "T"
    where = "in the taxi" if passenger == 4 else f"at {_TAXI_STOPS[passenger]}"
    return (
        "\n".join("".join(line) for line in grid)
        + f"\nThe taxi T is at row {taxi_row + 1}, column {taxi_col + 1}. The passenger is "
        f"{where}; the destination is {_TAXI_STOPS[dest]}."
    )


def _blackjack_render(env: gymnasium.Env, obs: Any) -> str:
    total, dealer, usable_ace = obs
    ace = " (an ace counted as 11)" if usable_ace else ""
    card = "an ace" if dealer == 1 else str(dealer)
    return f"Your cards total {total}{ace}. The dealer shows {card}."


TEXT_SPECS: dict[str, TextSpec] = {
    "FrozenLake": TextSpec(
        _frozen_lake_rules, ("LEFT", "DOWN", "RIGHT", "UP"), _frozen_lake_render
    ),
    "Taxi": TextSpec(
        lambda env: (
            "You drive a taxi T on the grid (walls are | and -). R, G, Y and B are stops. "
            "Drive to the passenger, PICKUP, drive to the destination, DROPOFF. Each move "
            "costs 1 point, a wrong PICKUP or DROPOFF 10, delivering earns 20."
        ),
        ("SOUTH", "NORTH", "EAST", "WEST", "PICKUP", "DROPOFF"),
        _taxi_render,
    ),
    "Blackjack": TextSpec(
        lambda env: (
            "You play blackjack against the dealer: get closer to 21 than the dealer "
            "without going over. HIT takes a card, STICK stops. Win 1, lose -1, draw 0."
        ),
        ("STICK", "HIT"),
        _blackjack_render,
    ),
}


def generic_spec(env: gymnasium.Env) -> TextSpec:
    """Words "0".."n-1"; the `ansi` render when the env was made with it, else the repr."""
    n = int(env.action_space.n)

    def render(e: gymnasium.Env, obs: Any) -> str:
        if e.render_mode == "ansi":
            return plain_ansi(str(e.render())).strip("\n")
        return f"Observation: {obs!r}"

    def rules(e: gymnasium.Env) -> str:
        marks = (
            " In the picture, [ ] marks the highlighted cell (usually where you are)."
            if e.render_mode == "ansi"
            else ""
        )
        return f"You play the Gymnasium environment {e.spec.id if e.spec else e}.{marks}"

    return TextSpec(rules, tuple(str(i) for i in range(n)), render)


def text_spec_name(game: gymnasium.Env) -> str:
    """The `TEXT_SPECS` key of `game`: by its unwrapped class for the toy-text envs (so
    `FrozenLake8x8-v1` is "FrozenLake"), else its id's name (`spec.name`); "" when it has none."""
    for cls, name in (
        (FrozenLakeEnv, "FrozenLake"),
        (TaxiEnv, "Taxi"),
        (BlackjackEnv, "Blackjack"),
    ):
        if isinstance(game.unwrapped, cls):
            return name
    return game.spec.name if game.spec is not None else ""


class GymTextEnv(Env):
    """A Gymnasium env with a discrete action space, observed and played in text.

    Constructor: `on_invalid` ("reprompt" | "end"), `invalid_penalty` (subtracted per invalid
    reply), `max_invalid` (invalid replies that end an episode). The task says which Gymnasium env
    to play (see `load_tasks`); docs/environments.md ("Gymnasium in text") says how it is
    rendered, parsed and rewarded.

    Example:
        >>> env = GymTextEnv(on_invalid="end")
        >>> task = GymTextEnv.load_tasks("eval", seed=0, n=1, env_id="Blackjack-v1")[0]
        >>> msgs, _ = env.reset(seed=0, options={"task": task})
        >>> env.step(Message(role="assistant", content="hmm"))[1:3]
        (-0.1, True)

        >>> tasks = GymTextEnv.load_tasks("train", seed=0, n=2, env_id="FrozenLake-v1",
        ...                               map_size=4)
        >>> env = GymTextEnv()
        >>> msgs, _ = env.reset(seed=0, options={"task": tasks[0]})
        >>> [m.role for m in msgs]
        ['system', 'user']
        >>> env.step(Message(role="assistant", content="I move RIGHT"))[3:5]
        (False, {'action': 'RIGHT', 'invalid_replies': 0})
    """

    def __init__(
        self,
        on_invalid: Literal["reprompt", "end"] = "reprompt",
        invalid_penalty: float = 0.1,
        max_invalid: int = 3,
    ) -> None:
        if on_invalid not in ("reprompt", "end"):
            raise ValueError(f"on_invalid must be 'reprompt' or 'end', got {on_invalid!r}")
        if invalid_penalty < 0 or max_invalid < 1:
            raise ValueError("need invalid_penalty >= 0 and max_invalid >= 1")
        self.on_invalid, self.invalid_penalty, self.max_invalid = (
            on_invalid,
            invalid_penalty,
            max_invalid,
        )
        self.game: gymnasium.Env | None = None

    def text_spec(self, game: gymnasium.Env) -> TextSpec | None:
        """How `game` reads as text (None: the generic rendering). Override it to teach the
        wrapper an env that `TEXT_SPECS` does not know."""
        return TEXT_SPECS.get(text_spec_name(game))

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed, options=options)
        assert self.task is not None
        meta = self.task.metadata
        if self.game is not None:
            self.game.close()
        env_id, make_kwargs = meta["env_id"], meta.get("make_kwargs", {})
        game = gymnasium.make(env_id, **make_kwargs)
        if not isinstance(game.action_space, gymnasium.spaces.Discrete):
            game.close()
            raise TypeError(
                f"{env_id} has action space {game.action_space}; GymTextEnv needs Discrete"
            )
        view = self.text_spec(game)
        if view is None:
            if "ansi" in game.metadata.get("render_modes", ()):
                game.close()
                game = gymnasium.make(env_id, render_mode="ansi", **make_kwargs)
            view = generic_spec(game)
        if len(view.action_words) != game.action_space.n:
            raise ValueError(
                f"{env_id}: {len(view.action_words)} action words for {game.action_space}"
            )
        self.game, self.view = game, view
        self.words = {w.lower(): i for i, w in enumerate(view.action_words)}
        self._word = re.compile(r"\b(" + "|".join(re.escape(w) for w in self.words) + r")\b", re.I)
        obs, _ = game.reset(seed=int(meta["reset_seed"]))
        self.invalid = 0
        system = f"{self.view.rules(game)}\n{self._ask()}"
        return [
            Message(role="system", content=system),
            Message(role="user", content=self.view.render(game, obs)),
        ], {}

    def _ask(self) -> str:
        return f"Reply with one action: {', '.join(self.view.action_words)}."

    def parse_action(self, text: str) -> int | None:
        """The last action word in `text` (case-insensitive, whole word), or None."""
        found = self._word.findall(text)
        return self.words[found[-1].lower()] if found else None

    def step(self, action: Message) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        assert self.game is not None, "reset() first"
        idx = self.parse_action(action.content)
        if idx is None:
            self.invalid += 1
            info = {"action": None, "invalid_replies": self.invalid}
            if self.on_invalid == "end" or self.invalid >= self.max_invalid:
                return EnvStep(
                    [], -self.invalid_penalty, True, False, info, stop_reason=StopReason.PARSE_ERROR
                )
            msg = f"That reply names no action. {self._ask()}"
            return [Message(role="user", content=msg)], -self.invalid_penalty, False, False, info
        obs, reward, terminated, truncated, _ = self.game.step(idx)
        info = {"action": self.view.action_words[idx], "invalid_replies": self.invalid}
        text = self.view.render(self.game, obs)
        if terminated or truncated:
            text += f"\nThe episode is over (reward {float(reward):g})."
        return (
            [Message(role="user", content=text)],
            float(reward),
            bool(terminated),
            bool(truncated),
            info,
        )

    def close(self) -> None:
        if self.game is not None:
            self.game.close()
            self.game = None

    @classmethod
    def load_tasks(
        cls,
        split: str = "train",
        seed: int = 0,
        *,
        n: int = 1000,
        env_id: str = "FrozenLake-v1",
        make_kwargs: dict[str, Any] | None = None,
        map_size: int | None = None,
        **kwargs: Any,
    ) -> Sequence[Task]:
        """`n` start states of `env_id` (`make_kwargs` go to `gymnasium.make`; `map_size` gives
        FrozenLake a random solvable map of that size per task)."""
        if kwargs:
            raise TypeError(f"GymTextEnv.load_tasks: unknown options {sorted(kwargs)}")
        if map_size is not None and not env_id.startswith("FrozenLake"):
            raise ValueError("map_size applies to FrozenLake only")
        gymnasium.spec(env_id)  # an unknown id fails here, naming it, not at the first rollout
        rng = random.Random(f"gym_text/{env_id}/{split}/{seed}")
        tasks = []
        for i in range(n):
            kw = dict(make_kwargs or {})
            if map_size is not None:
                kw["desc"] = generate_random_map(size=map_size, seed=rng.randrange(2**31))
            reset_seed = rng.randrange(2**31)
            tasks.append(
                Task(
                    id=f"{env_id}-{split}-{seed}-{i}",
                    prompt=f"Play {env_id} from start state {reset_seed}.",
                    metadata={"env_id": env_id, "make_kwargs": kw, "reset_seed": reset_seed},
                )
            )
        return tasks
