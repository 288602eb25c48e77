"""The composition root: ``sao train`` (:mod:`sao.app.run`), the builders
that turn a :class:`~sao.config.Config` into parts, the engine factory, the
expected peak memory checked before training, warm starts, the builders the
Ray backend calls. It may import every folder below it; nothing imports it
but ``sao.cli`` and ``sao.experiments`` (which runs it in subprocesses and
reads the warm starts' cache paths)."""
