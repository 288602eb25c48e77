"""Rollout: the ``Engine`` protocol, the embedded ``TorchEngine``, the
multi-turn agent loop (:func:`run_episode`) and the engine-vs-trainer
log-probability check (:func:`check_logprobs`)."""

from sao.rollout.agent import EpisodeLimits, run_episode
from sao.rollout.check import LogprobReport, check_logprobs
from sao.rollout.engine import Engine
from sao.rollout.torch_engine import TorchEngine

__all__ = [
    "Engine",
    "EpisodeLimits",
    "LogprobReport",
    "TorchEngine",
    "check_logprobs",
    "run_episode",
]
