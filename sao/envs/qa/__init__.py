"""Single-turn tasks scored by the reply's final answer: ``dataset`` (local
files), ``reasoning_gym``, and the answer markers and scorers they share
(:mod:`~sao.envs.qa.answers`). They import only :mod:`sao.types`, ``sao.envs``'
shared pieces and, on use, the optional math-verify and reasoning-gym."""
