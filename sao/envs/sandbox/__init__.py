"""The code sandbox for environments that run model-written code:
:func:`run_python` and :func:`run_shell` (:mod:`~sao.envs.sandbox.execute`),
the supervisor program that builds the jail and applies the limits, and the
host-side process control. It imports only the standard library."""

from sao.envs.sandbox.execute import (
    Isolation,
    SandboxResult,
    describe_isolation,
    run_python,
    run_shell,
)

__all__ = ["Isolation", "SandboxResult", "describe_isolation", "run_python", "run_shell"]
