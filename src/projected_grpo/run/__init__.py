"""One training run: setup, sampling, the rollout step, the loop, checkpoints, metrics."""
