"""The composition root: ``sao train`` (:mod:`sao.app.run`), the builders
that turn a :class:`~sao.config.Config` into parts, the engine factory and
warm starts. It may import every other folder; nothing imports it but
``sao.cli`` and ``sao.experiments`` (through subprocesses)."""
