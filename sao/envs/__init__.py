"""Environments: the ``Env`` and ``Task`` protocols, the built-in tasks,
reward functions and dataset adapters; ``sandbox/`` runs model-written code,
``swe/`` is the repository-repair task. It imports only the types (and
``sandbox/``, which imports nothing of sao)."""
