"""Full fine-tuning against LoRA, side by side: a run's peak memory, its actor
step time and what each weight sync moves, for SAO and GRPO on SmolLM2-135M.

Each arm is a ``sao train`` subprocess (a fresh allocator) of the same preset,
seed and number of actor steps; the figures are the run's own metrics
(``memory/peak_gib``, ``time/train_step_s`` over the actor steps,
``publish/sync_s``) and its printed estimate. SAO arms put adapters of the same
rank on the actor and on the critic (``model.lora``, ``model.critic_lora``).
The bytes an update sends are counted on the policy itself: the full state
dict (unique tensors: the tied head is the embedding); with LoRA the adapted
modules' merged weights (the embedded engine, copied in process), the
adapters alone (``sao serve`` through the weight directory), and the merged
modules with whole fused q/k/v and gate/up groups (vLLM).

    sao models fetch smollm2-135m
    PYTHONPATH=. python benchmarks/lora.py [--steps 4] [--ranks 8 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from benchmarks._bench import QUIET
from sao.app.cpu import cpu_model

PRESETS = {"sao": "smollm2-arith-sao", "grpo": "smollm2-arith"}


def run_arm(preset: str, steps: int, seed: int, sets: list[str], run_dir: Path) -> dict:
    """One run: its actor-step rows, summary and printed estimate."""
    warm = ["algo.critic_pretrain_steps=1"] if preset.endswith("-sao") else []
    every = [f"train.steps={steps + len(warm)}", f"seed={seed}", f"log.run_dir={run_dir}"]
    cmd = [sys.executable, "-m", "sao.cli", "train", "--preset", preset]
    for s in [*every, *warm, "eval.every=1000", "eval.episodes=8", *QUIET, *sets]:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ).stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    estimate = next((ln for ln in out.splitlines() if ln.startswith("memory: expected")), "")
    return {"rows": [r for r in rows if "actor/loss" in r], "summary": summary, "est": estimate}


def sync_bytes(ranks: list[int]) -> list[tuple[str, float, float, float]]:
    """(arm, MB an update sends: the embedded engine, `sao serve` through the
    weight directory, vLLM) on SmolLM2-135M."""
    import torch

    from sao.models.fetch import resolve_model_path
    from sao.models.loading import load_policy
    from sao.models.lora import adapter_update, add_lora, published_state
    from sao.rollout.weights import _unique

    def mb(state: Mapping[str, torch.Tensor]) -> float:
        tensors, _ = _unique(dict(state))
        return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6

    path = resolve_model_path("smollm2-135m")
    full = mb(published_state(load_policy(path)))
    out = [("full fine-tuning", full, full, full)]
    for targets in ("all-linear", ["q_proj", "v_proj"]):
        for r in ranks:
            policy = load_policy(path)
            add_lora(policy, rank=r, alpha=2.0 * r, targets=targets)
            name = f"LoRA rank {r}, {'all-linear' if targets == 'all-linear' else 'q, v'}"
            merged, fused = published_state(policy), published_state(policy, fused=True)
            out.append((name, mb(merged), mb(adapter_update(policy)[0]), mb(fused)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="actor steps per run")
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--algos", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    args = ap.parse_args()
    print(f"SmolLM2-135M, {args.steps} actor steps, seed {args.seed}; CPU: {cpu_model()}")
    arms: dict[str, list[str]] = {"full": []}
    for r in args.ranks:
        arms[f"lora{r}"] = [f"model.lora.rank={r}", f"model.lora.alpha={2 * r}"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos:
            for arm, sets in arms.items():
                if algo == "sao" and arm != "full":
                    sets = [*sets, *(s.replace("model.lora", "model.critic_lora") for s in sets)]
                key = f"{algo} {arm}"
                results[key] = run_arm(PRESETS[algo], args.steps, args.seed, sets, Path(tmp) / key)
                print(f"{key}: {results[key]['est']}", flush=True)
    print("\n| run | peak GiB | expected GiB | actor step s | sync s | vs full: peak, step |")
    print("|---|---|---|---|---|---|")
    for key, res in results.items():
        s, rows = res["summary"], res["rows"]
        step = sum(r["time/train_step_s"] for r in rows) / max(len(rows), 1)
        syncs = [r["publish/sync_s"] for r in rows if "publish/sync_s" in r]
        sync = sum(syncs) / max(len(syncs), 1)
        base = results[f"{key.split()[0]} full"]
        b_rows = base["rows"]
        b_step = sum(r["time/train_step_s"] for r in b_rows) / max(len(b_rows), 1)
        peak_ratio = s["memory/peak_gib"] / base["summary"]["memory/peak_gib"]
        ratio = f"{peak_ratio:.2f}x, {step / b_step:.2f}x"
        print(
            f"| {key} | {s['memory/peak_gib']:.2f} | {s['memory/expected_peak_gib']:.2f} | "
            f"{step:.1f} | {sync:.3f} | {ratio} |"
        )
    print("\n| an update sends (MB) | embedded engine | sao serve (directory) | vLLM |")
    print("|---|---|---|---|")
    for name, merged, adapters, fused in sync_bytes(args.ranks):
        print(f"| {name} | {merged:.1f} | {adapters:.1f} | {fused:.1f} |")


if __name__ == "__main__":
    main()
