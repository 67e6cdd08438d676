"""The model a run uses and what this machine runs it in: the embedded SmolLM2-135M-Instruct
(converted once, cached), loading a policy, the precision and threads the hardware supports."""

from agentgrpo.models.embedded import default_model_path, load_policy

__all__ = ["default_model_path", "load_policy"]
