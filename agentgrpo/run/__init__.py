"""The run level: the config, the training loop and its scheduler, evaluation, checkpoints, logs."""
