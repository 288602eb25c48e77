"""The ``style_shift`` task, the online-learning simulation whose preferred
style changes during training (:mod:`~sao.envs.style.shift`), and its judges
(:mod:`~sao.envs.style.judges`). They import only ``sao.envs``' shared pieces
and the standard library."""
