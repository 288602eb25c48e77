"""Rollout: the ``Engine`` protocol and the multi-turn agent loop
(:func:`run_episode`: chat templates, the TITO check, env calls, resume) and
the engine-vs-trainer log-probability check. ``embedded/`` holds the
in-process engine, ``remote/`` the HTTP engines and servers. It imports only
types, models and the env protocol."""

from sao.rollout.agent import EpisodeLimits, run_episode
from sao.rollout.check import LogprobReport, check_logprobs
from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.engine import Engine

__all__ = [
    "Engine",
    "EpisodeLimits",
    "LogprobReport",
    "TorchEngine",
    "check_logprobs",
    "run_episode",
]
