"""The learner: packing trajectories into micro-batches, their logprobs, the loss step through
accelerate, LoRA and checkpoints of the learner's state. `Learner` is imported lazily so that
packing (`learner.batch`) loads no accelerate."""

__all__ = ["Learner"]


def __getattr__(name: str):
    if name == "Learner":
        from agentgrpo.learner.learner import Learner

        return Learner
    raise AttributeError(name)
