"""Checks a user runs before training: `check-env` (an env's promises) and `check-template` (a chat
template under which the learner would see the tokens the engine saw)."""
