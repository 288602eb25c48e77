"""Ray's worker processes of this test's own cluster (several test processes,
``pytest -n N``, may each run a Ray cluster on the machine at once)."""

from __future__ import annotations

import os

import psutil


def own_ray_pids(title: str) -> list[int]:
    """PIDs of the Ray workers named ``title`` (``ray::RolloutWorker``) that
    this process started: a local cluster's workers are the children of its
    raylet, which is this process's child. Oldest first."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        try:
            if title in " ".join(proc.info["cmdline"] or ()) and me in {
                p.pid for p in proc.parents()
            }:
                found.append((proc.info["create_time"], proc.pid))
        except psutil.Error:  # gone meanwhile
            continue
    return [pid for _, pid in sorted(found)]
