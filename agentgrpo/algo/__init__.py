"""The algorithms, pure functions over tensors: advantages, policy losses and their terms, DAPO's
reward shaping and dynamic-sampling filter."""

from agentgrpo.algo.advantage import compute_advantages
from agentgrpo.algo.loss import gspo_loss, kl_penalty, policy_loss

__all__ = ["compute_advantages", "gspo_loss", "kl_penalty", "policy_loss"]
