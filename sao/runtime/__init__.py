"""The asynchronous loop alone: the orchestrator, the staleness gate,
admission, the trajectory buffer, the episode runner, held-out evaluation,
the run's memory readings and the ``TrainerHandle`` protocol that the local
and Ray trainers implement. It imports rundir, train, rollout, envs, models
and types; never app, distributed or experiments."""
