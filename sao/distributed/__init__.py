"""The Ray backend: rollout workers, trainer ranks (FSDP2 groups),
placement and weight broadcast. It builds on :mod:`sao.runtime`,
:mod:`sao.train` and :mod:`sao.rollout`; the async loop never imports it."""
