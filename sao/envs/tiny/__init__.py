"""The tiny multi-turn tasks a small policy learns on a CPU: ``calculator``,
``guess_number`` and ``python_tool``, problems drawn from a seed, line-format
actions (``calc 3*4``, ``guess 16``, ``run CODE``) and exact scores. They
import only :mod:`sao.types`, ``sao.envs``' shared pieces and the sandbox."""
