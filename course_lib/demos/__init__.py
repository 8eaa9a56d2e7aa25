"""Entry points for `torchrun` and `python -m` demos (see README, "Running on GPUs")."""
