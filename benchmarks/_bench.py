"""What the training benchmarks share."""

QUIET = (
    "log.live=false",
    "log.tensorboard=false",
    "log.plots=false",
    "log.checkpoint_every=1000000",
    "train.logprob_budget=0",
)
"""Overrides of a run measured for speed: no live view, tracker, plots or
checkpoints, and no start-up log-prob check."""
