"""Rollout: the ``Engine`` protocol and the multi-turn agent loop
(:func:`run_episode`: chat templates, the TITO check, env calls, resume) and
the engine-vs-trainer log-probability check, and :mod:`~sao.rollout.openmp`,
which idle threads call so the engine's decode keeps its speed. ``embedded/`` holds the
in-process engine (:class:`~sao.rollout.embedded.engine.TorchEngine`),
``remote/`` the HTTP engines and servers; both build on these contracts, which
import only types and models (and never an engine)."""

from sao.rollout.agent import EpisodeLimits, run_episode
from sao.rollout.check import LogprobReport, check_logprobs
from sao.rollout.engine import Engine

__all__ = [
    "Engine",
    "EpisodeLimits",
    "LogprobReport",
    "check_logprobs",
    "run_episode",
]
