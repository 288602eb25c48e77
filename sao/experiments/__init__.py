"""``sao experiment``: grids of arms x seeds (:mod:`~sao.experiments.grid`),
the runner of their ``sao train`` subprocesses, and the report rebuilt from
the run directories. It imports the composition root (warm starts' paths),
rundir, config and envs (a task's schedule); nothing imports it but
:mod:`sao.cli`."""
