"""sao: Single-rollout Asynchronous Optimization for agentic reinforcement
learning of language models."""

import os as _os

__version__ = "0.1.0"

# Torch's CPU threads (GNU OpenMP) spin at every barrier for ~300k rounds before
# sleeping. When another process holds a core, and more so from another session
# (Linux autogroups share CPU per session), a spinning thread burns the time its
# partner needs: a warm-start build measured >200 s instead of 14-19 s on 2 cores
# with one busy (BENCHMARKS.md, "The test suite"). A short spin keeps quiet-machine
# speed. It takes effect only if sao is imported before torch; a value set wins.
_os.environ.setdefault("GOMP_SPINCOUNT", "1000")
