"""A run's memory over its steps, side by side: as sao runs it (the allocator's
freed pages given back after each trainer step, torch's large blocks in
transparent huge pages: ``release_thp``), in 4 KiB pages (``release``), without
giving pages back (``keep``, what runs did before), and with activation
checkpointing (``ckpt``); and as sao runs it with ``runtime.backend=ray``
(``ray``: its estimate and figures sum the driver, Ray's processes, two rollout
workers and a trainer rank).

Each arm is a ``sao train`` subprocess (a fresh allocator) of the same preset,
seed and steps; the figures are the run's own ``memory/*`` metrics
(sao.runtime.memory: resident memory of the process tree after each step, the
peak with the process's high-water mark, glibc's live heap) and its printed
estimate (sao.app.memory). Step times are the trainer's (``time/train_step_s``),
mean over the actor steps. Every 5 s the run's processes are read by role
(driver, trainer rank, rollout worker, Ray's own; each child's proportional
share): the sample with the largest total is printed, split by process.

    PYTHONPATH=. python benchmarks/run_memory.py [--preset smollm2-arith-sao] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._bench import QUIET
from sao.app.cpu import cpu_model
from sao.runtime.memory import descendants, proportional_bytes, resident_bytes

# torch's CPU allocator: blocks >= 2 MiB aligned and madvised as transparent huge pages
# (THP_MEM_ALLOC_ENABLE=1, sao's default) or not
ARMS: dict[str, tuple[str, dict[str, str]]] = {  # --set, environment
    "release": ("train.release_memory=true", {"THP_MEM_ALLOC_ENABLE": "0"}),
    "keep": ("train.release_memory=false", {"THP_MEM_ALLOC_ENABLE": "0"}),
    "release_thp": ("train.release_memory=true", {"THP_MEM_ALLOC_ENABLE": "1"}),
    "ckpt": ("train.activation_checkpointing=true", {"THP_MEM_ALLOC_ENABLE": "1"}),
    # the default, with Ray rollout workers (2) and a trainer rank in processes of their own
    "ray": ("runtime.backend=ray", {"THP_MEM_ALLOC_ENABLE": "1"}),
}


ROLES = {"ray::TrainerRank": "trainer rank", "ray::RolloutWorker": "rollout worker"}


def _role(pid: int, root: int) -> str:
    """What a process of the run is: the driver, a trainer rank, a rollout worker,
    or one of Ray's own (GCS, raylet, dashboard, agents)."""
    if pid == root:
        return "driver"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    return next((role for key, role in ROLES.items() if cmd.startswith(key)), "Ray's own")


def sample_processes(root: int) -> dict[str, list[float]]:
    """The run's processes now, by role: each one's proportional share in GiB
    (``Pss``; the driver by its resident memory, as the run counts it)."""
    out: dict[str, list[float]] = {"driver": [resident_bytes(root) / 2**30]}
    for pid in descendants(root):
        role = _role(pid, root)
        if role != "gone":
            out.setdefault(role, []).append(proportional_bytes(pid) / 2**30)
    return out


def run_arm(
    preset: str, steps: int, seed: int, arm: tuple[str, dict[str, str]], run_dir: Path
) -> dict[str, object]:
    """One run; its metrics rows, summary, printed estimate and, every 5 s, its
    processes' shares by role (the largest total seen, and that sample's split)."""
    setting, env = arm
    sets = [
        f"train.steps={steps}", f"seed={seed}", f"log.run_dir={run_dir}", setting,
        "eval.every=1000", *QUIET,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "sao.cli", "train", "--preset", preset]
    for s in sets:
        cmd += ["--set", s]
    environ = os.environ | env
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.DEVNULL, text=True, env=environ)
        largest: dict[str, list[float]] = {}
        while proc.poll() is None:
            now = sample_processes(proc.pid)
            if sum(map(sum, now.values())) > sum(map(sum, largest.values())):
                largest = now
            time.sleep(5)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
        log.seek(0)
        out = log.read()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    estimate = next((ln for ln in out.splitlines() if ln.startswith("memory: expected")), "")
    return {"rows": rows, "summary": summary, "estimate": estimate, "processes": largest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-arith-sao")
    ap.add_argument("--steps", type=int, default=6, help="actor steps (warm-up steps come first)")
    ap.add_argument("--seed", type=int, default=23)
    local = [a for a in ARMS if a != "ray"]
    ap.add_argument("--arms", nargs="+", default=local, choices=list(ARMS))
    args = ap.parse_args()
    print(f"{args.preset}, {args.steps} actor steps, seed {args.seed}; CPU: {cpu_model()}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms:
            results[arm] = run_arm(args.preset, args.steps, args.seed, ARMS[arm], Path(tmp) / arm)
    for arm, res in results.items():
        print(f"{arm}: {res['estimate']}")
    head = "".join(f"{'rss':>6}{'peak':>6}{'step_s':>7}{'flt_M':>6} " for _ in results)
    print("\n" + " " * 4 + "".join(f"{a:^26}" for a in results))
    print(f"{'step':>4}{head}   (GiB; train step s; page faults, millions)")
    per_arm = {a: {int(r["step"]): r for r in res["rows"]} for a, res in results.items()}  # type: ignore[union-attr]
    for step in sorted(per_arm[args.arms[0]]):
        cells = ""
        for arm in results:
            r = per_arm[arm].get(step, {})
            nan = float("nan")
            cells += f"{r.get('memory/rss_gib', nan):>6.2f}{r.get('memory/peak_gib', nan):>6.2f}"
            cells += f"{r.get('time/train_step_s', nan):>7.1f}"
            cells += f"{r.get('memory/page_faults_m', nan):>6.2f} "
        print(f"{step:>4}{cells}")
    print()
    for arm, res in results.items():
        s = res["summary"]  # type: ignore[index]
        actor = [r["time/train_step_s"] for r in res["rows"] if "actor/loss" in r]  # type: ignore[union-attr]
        mean = sum(actor) / max(len(actor), 1)
        peak, expected = s["memory/peak_gib"], s["memory/expected_peak_gib"]
        print(
            f"{arm:>8}: peak {peak:.2f} GiB, expected {expected:.2f} (ratio "
            f"{peak / expected:.2f}); mean actor step {mean:.1f} s; run {s['wall_s']:.0f} s"
        )
        procs: dict[str, list[float]] = res["processes"]  # type: ignore[assignment]
        if len(procs) > 1:  # (a Ray run: the sample of the largest total, by role)
            split = "; ".join(
                f"{role} {' + '.join(f'{g:.2f}' for g in sorted(gibs))}"
                for role, gibs in sorted(procs.items())
            )
            print(f"{'':>8}  its processes at their largest sample (GiB): {split}")


if __name__ == "__main__":
    main()
