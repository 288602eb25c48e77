"""Environments: the ``Env`` and ``Task`` protocols, the registry, the latency
wrapper and the pieces every task shares (``_split``, ``_state``, ``_tools``);
the tasks live in ``tiny/``, ``qa/`` (answer-scored), ``style/``, ``swe/``,
and ``sandbox/`` runs model-written code (it imports nothing of sao). It imports
only types."""
