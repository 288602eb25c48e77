"""sao: Single-rollout Asynchronous Optimization for agentic reinforcement
learning of language models."""

import os as _os

__version__ = "0.1.0"

# Torch's CPU threads (GNU OpenMP) spin at every barrier before sleeping:
# ~300k rounds by default. A long spin keeps the workers awake between short
# parallel regions (a batch-1 decode step runs ~121 GEMVs), but when another
# session holds a core it burns the time a descheduled partner needs (Linux
# autogroups share the CPU per session). benchmarks/spin.py, 2 cores (BENCHMARKS.md,
# "The test suite, and a busy core"): at 10,000 rounds a quiet machine trains
# and decodes as fast as at the default (1.3x and 1.4x faster than at 1,000);
# a busy core makes training 3.3x slower than quiet (1,000: 1.7x; the default:
# 34x). It takes
# effect only if sao is imported before torch; a value set wins, and servers of
# other projects that sao launches get their own default (SPIN_SET_BY_SAO).
SPIN_SET_BY_SAO = "GOMP_SPINCOUNT" not in _os.environ
_os.environ.setdefault("GOMP_SPINCOUNT", "10000")
