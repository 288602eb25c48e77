"""What one Ray rollout worker holds, stage by stage: after it builds its
engine, after each weight update resolved from the object store, after a batch
of episodes. Per stage, the worker's resident memory split by kind (anonymous:
its heap and torch's tensors; file: mapped libraries and files; shmem: pages of
Ray's object store mapped into it) with its proportional share (``Pss``: a page
shared by n processes counts 1/n), and glibc's live heap.

The worker is sao's own (:class:`sao.distributed.backend.RolloutWorker`, built
by the composition root's builder) with one method added to read itself; the
driver stands in for the trainer's rank 0 and puts the policy's state dict
in the object store for each update, as ``RayTrainerGroup.weights`` does.

    PYTHONPATH=. python benchmarks/ray_worker_memory.py [--preset smollm2-guess-sao] \
        [--updates 3] [--episodes 16] [--tensors]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from sao.app.cpu import cpu_model

GIB = 2**30
FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")
STATUS = ("RssAnon", "RssFile", "RssShmem")


def read_memory(pid: int | str = "self") -> dict[str, float]:
    """GiB by kind for one process: smaps_rollup's totals and status's splits."""
    out: dict[str, float] = {}
    for path, keys in ((f"/proc/{pid}/smaps_rollup", FIELDS), (f"/proc/{pid}/status", STATUS)):
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in keys:
                out[key] = int(rest.split()[0]) * 1024 / GIB
    return out


def probe_class() -> type:
    from sao.distributed.backend import RolloutWorker
    from sao.runtime.memory import heap_live

    class Probe(RolloutWorker):  # type: ignore[misc]
        def memory(self) -> dict[str, float]:
            out = read_memory()
            live = heap_live()
            out["heap_live"] = (live or 0) / GIB
            return out

    return Probe


def update(policy: Any, tensors: bool) -> Any:
    """What rank 0 puts in the object store for an update (or torch tensors)."""
    from sao.distributed.shared import to_shared

    state = {k: t.detach().clone() for k, t in policy.state_dict().items()}
    return state if tensors else to_shared(state)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="smollm2-guess-sao")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument(
        "--tensors",
        action="store_true",
        help="put torch tensors in the object store (each worker unpickles a copy), not "
        "the arrays the trainer puts (sao.distributed.shared)",
    )
    p.add_argument("--set", action="append", default=[], help="config overrides (key=value)")
    args = p.parse_args()

    import ray
    import torch

    from sao.app.distributed import build_rollout_worker
    from sao.app.parts import policy_path
    from sao.config.resolve import load_config, to_dict
    from sao.models.loading import load_policy
    from sao.types import SamplingParams

    cfg = load_config(preset=args.preset, overrides=["runtime.backend=ray", *args.set])
    model_dir = policy_path(cfg)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    worker = (
        ray.remote(probe_class())
        .options(num_cpus=1)
        .remote(to_dict(cfg), str(model_dir), None, [], 0, build_rollout_worker)
    )
    pid = await worker.start.remote()
    rows: list[tuple[str, dict[str, float]]] = [("engine built", await worker.memory.remote())]

    policy = load_policy(model_dir, dtype=torch.float32)
    for v in range(1, args.updates + 1):
        await publish(ray, worker, policy, v, args.tensors)
        rows.append((f"update {v}", await worker.memory.remote()))

    sampling = SamplingParams(
        temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens
    )
    calls = [
        worker.run.remote("train", i, i, f"p{i}", f"g{i}", sampling) for i in range(args.episodes)
    ]
    await asyncio.gather(*calls)
    rows.append((f"{args.episodes} episodes", await worker.memory.remote()))
    await publish(ray, worker, policy, args.updates + 1, args.tensors)
    rows.append(("update after episodes", await worker.memory.remote()))

    params = sum(t.numel() * t.element_size() for t in policy.state_dict().values()) / GIB
    how = "torch tensors" if args.tensors else "arrays (sao.distributed.shared)"
    print(f"{args.preset}, one worker (pid {pid}), updates of {params:.2f} GiB as {how}")
    print(f"(GiB) {cpu_model()}")
    print_table(rows)
    ray.shutdown()


async def publish(ray: Any, worker: Any, policy: Any, version: int, tensors: bool) -> None:
    """A new version of ``policy`` (every weight moved, as a trainer step moves
    them) put in the object store and applied by ``worker``."""
    import torch

    with torch.no_grad():
        for t in policy.parameters():
            t.mul_(1.0 + 1e-6)
    ref = ray.put(update(policy, tensors))
    await worker.update_weights.remote(ref, version)


def print_table(rows: list[tuple[str, dict[str, float]]]) -> None:
    cols = (*FIELDS, *STATUS, "heap_live")
    print("| stage | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, m in rows:
        print(f"| {name} | " + " | ".join(f"{m.get(c, 0):.2f}" for c in cols) + " |")


if __name__ == "__main__":
    asyncio.run(main())
