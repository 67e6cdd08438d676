"""An OpenEnv environment as OpenEnv's docs lay one out (typed Action and Observation, an
Environment with reset/step/state, `create_app` for the server), for tests/test_env_openenv.py:
guess a number from 1 to 10 that the seed picks; the env answers higher or lower.

Served with `python -m uvicorn guess_env:app` from this folder. `GUESS_FAIL_STEP=1` in the
server's environment makes `step` raise (a broken server, for the infrastructure-error test).
"""

import os
import random
from uuid import uuid4

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field


class GuessAction(Action):
    guess: str = Field(..., min_length=1, description="the number guessed")


class GuessObservation(Observation):
    text: str = Field("", description="what the env says")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.secret = random.Random(seed).randint(1, 10)
        return GuessObservation(text="Guess my number from 1 to 10. Reply with the number only.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if os.environ.get("GUESS_FAIL_STEP"):
            raise RuntimeError("the game's database is down")
        self._state.step_count += 1
        guess = action.guess.strip()
        if guess == str(self.secret):
            return GuessObservation(text="Correct!", done=True, reward=1.0)
        hint = "higher" if guess.isdigit() and int(guess) < self.secret else "lower"
        return GuessObservation(text=f"No, {hint}.", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=2)
