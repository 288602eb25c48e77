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

# Torch's CPU allocator aligns every block of 2 MiB or more to 2 MiB and asks the
# kernel for transparent huge pages there (where its THP mode is `madvise` or
# `always`). A trainer step touches GBs of activations; after each step sao gives
# the freed pages back (sao.runtime.memory), and touching them again in 4 KiB
# pages cost SmolLM2-135M's SAO step ~2.4M page faults and ~20% of its time; in
# huge pages ~0.3M and about none (BENCHMARKS.md, "A run's memory"). A value set
# wins; servers of other projects that sao launches do without (THP_SET_BY_SAO).
THP_SET_BY_SAO = "THP_MEM_ALLOC_ENABLE" not in _os.environ
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
