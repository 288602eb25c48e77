"""The Ray backend: rollout workers, trainer ranks (FSDP2 groups),
placement and weight broadcast. It imports runtime, train, rollout, envs,
config and types, never the composition root: what it builds with (engines,
trainers, servers) the root hands in (:mod:`~sao.distributed.builders`).
Only :mod:`sao.app` and :mod:`sao.cli` import it."""
