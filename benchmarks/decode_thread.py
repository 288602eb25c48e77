"""The embedded engine's decode step on the main thread and on a second thread.

The engine decodes on its own thread (``sao-torch-engine``) while the main
thread runs the event loop, and has already run torch's OpenMP parallel
regions (loading the model). This times the same ``StaticKVForward.decode``
of SmolLM2-135M at batch 1 (48 cached positions) on the main thread, on a
second thread, and on the main thread again, in one process.
``--main-threads 1`` keeps the main thread at one torch thread (it never
starts an OpenMP team of workers) while the second thread uses ``--threads``;
``--idle-team`` also keeps a third thread's team alive, idle, as the
trainer's thread did in a run before idle threads gave theirs back;
``--release`` has the main thread give its team back
(:func:`sao.rollout.openmp.release_team`, as the engine's builder does)
before the second thread decodes. ``sao`` is imported before torch, so the
OpenMP spin is sao's default (``GOMP_SPINCOUNT`` set in the environment wins):

    SAO_REAL_MODEL=$(sao models fetch smollm2-135m | tail -n 1) \\
    PYTHONPATH=. python benchmarks/decode_thread.py [--threads 2] [--main-threads 1] \\
        [--idle-team] [--release]
"""

from __future__ import annotations

import sao  # noqa: F401  (before torch: sao's GOMP_SPINCOUNT default, as in `sao`)

# isort: split
import argparse
import os
import threading
import time

import torch

from sao.models.loading import load_policy
from sao.rollout.embedded.kv_forward import StaticKVForward
from sao.rollout.openmp import release_team


def step_ms(forward: StaticKVForward, steps: int = 20) -> float:
    """Milliseconds per batch-1 decode step (after 3 warm-up steps)."""
    for i in range(3):
        forward.decode([0], [5], [48 + i])
    t0 = time.perf_counter()
    for i in range(steps):
        forward.decode([0], [5], [51 + i])
    return 1e3 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("SAO_REAL_MODEL", ""))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--main-threads", type=int, default=None, help="default: --threads")
    ap.add_argument("--idle-team", action="store_true", help="a third thread's live team")
    ap.add_argument("--release", action="store_true", help="main gives its team back first")
    args = ap.parse_args()
    if not args.model:
        ap.error("--model: the SmolLM2 directory `sao models fetch smollm2-135m` prints")
    main_threads = args.main_threads or args.threads
    torch.set_num_threads(main_threads)
    model = load_policy(args.model).eval().requires_grad_(False)
    forward = StaticKVForward(model, max_batch_size=1, max_seq_len=256)
    forward.prefill([0], [list(range(100, 148))])
    out: dict[str, float] = {"main thread": step_ms(forward)}

    def on_thread() -> None:
        torch.set_num_threads(args.threads)
        out["second thread"] = step_ms(forward)

    started, stop = threading.Event(), threading.Event()

    def idle_team() -> None:
        torch.set_num_threads(args.threads)
        torch.randn(1024, 1024).square().sum()  # a parallel region: the team exists
        started.set()
        stop.wait()

    if args.idle_team:
        threading.Thread(target=idle_team, daemon=True).start()
        started.wait()
    if args.release:
        release_team()
    t = threading.Thread(target=on_thread)
    t.start()
    t.join()
    stop.set()
    out["main thread again"] = step_ms(forward)
    print(
        f"SmolLM2-135M float32, batch 1, ms per decode step; torch threads: main "
        f"{main_threads}, second thread {args.threads}"
    )
    for where, ms in out.items():
        print(f"  {where:<18} {ms:6.1f}")


if __name__ == "__main__":
    main()
