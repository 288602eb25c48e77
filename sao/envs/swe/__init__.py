"""``swe``: fix a small repository with file and shell tools until its tests
pass (SWE-bench style). See ``docs/environments.md`` and the modules:
:mod:`~sao.envs.swe.protocol` (the tool calls), :mod:`~sao.envs.swe.workspace`
(the working copy), :mod:`~sao.envs.swe.grading` (the reward),
:mod:`~sao.envs.swe.synthetic` (generated problems),
:mod:`~sao.envs.swe.instances` (your own SWE-bench-layout instances)."""

from sao.envs.swe.env import SweEnv, SweOptions
from sao.envs.swe.grading import Grade, reward_of
from sao.envs.swe.instances import load_instances
from sao.envs.swe.problem import SweProblem
from sao.envs.swe.protocol import parse_call
from sao.envs.swe.task import SweTask

__all__ = [
    "Grade",
    "SweEnv",
    "SweOptions",
    "SweProblem",
    "SweTask",
    "load_instances",
    "parse_call",
    "reward_of",
]
