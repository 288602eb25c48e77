"""What GNU OpenMP's spin count costs and buys: ``GOMP_SPINCOUNT`` for sao's default.

A torch thread that reaches an OpenMP barrier spins ``GOMP_SPINCOUNT`` rounds
before it sleeps. A long spin keeps workers awake between short parallel
regions (the ~121 GEMVs of a batch-1 decode step); it also burns a core's time
while the thread's partner waits to run, when another session keeps a core
busy (BENCHMARKS.md, "The test suite, and a busy core"). ``import sao`` sets
the default (sao/__init__.py). For each spin count (read once, when torch
loads, so each runs in a fresh child process) this times two workloads, on a
quiet machine and beside a busy loop started in a session of its own:

- ``train``: 30 AdamW steps of the 1M-parameter tiny Llama on 16 x 128 tokens,
  the many small parallel regions of a warm-start build;
- ``decode``: the embedded engine's batch-1 greedy decoding of SmolLM2-135M
  (4 requests x 64 tokens, after a warm-up), where the model is at hand.

    SAO_REAL_MODEL=$(sao models fetch smollm2-135m | tail -n 1) \\
    PYTHONPATH=. python benchmarks/spin.py [--spins 1000,5000,10000,300000] [--no-busy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

HOG = "while True: pass"


def train_s(steps: int = 30) -> float:
    """Seconds for ``steps`` AdamW steps of the tiny Llama (after one warm-up)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sao.models.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", "1m", vocab_size=512, pad_token_id=0, eos_token_id=1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(2, 512, (16, 128))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - t0


def decode_ms(model_dir: str, requests: int = 4, new: int = 64) -> float:
    """Milliseconds per token of the embedded engine at batch 1, greedy."""
    from sao.models.loading import load_policy
    from sao.rollout.embedded.engine import TorchEngine
    from sao.types import SamplingParams

    model = load_policy(model_dir).eval()

    async def run() -> float:
        with TorchEngine(model, max_batch_size=1, max_seq_len=256) as engine:
            engine.eos_token_ids = ()  # every request runs ``new`` tokens
            prompt = list(range(100, 148))
            await engine.generate(prompt, SamplingParams(top_k=1, max_new_tokens=4))
            t0 = time.perf_counter()
            for _ in range(requests):
                await engine.generate(prompt, SamplingParams(top_k=1, max_new_tokens=new))
            return 1e3 * (time.perf_counter() - t0) / (requests * new)

    return asyncio.run(run())


def child(workload: str, model_dir: str) -> None:
    import sao  # noqa: F401  (before torch, as the sao command does)

    value = train_s() if workload == "train" else decode_ms(model_dir)
    print(json.dumps({"value": value, "spin": os.environ.get("GOMP_SPINCOUNT")}))


def measure(workload: str, spin: int, model_dir: str, busy: bool, timeout_s: float) -> float:
    """One child process's figure, with ``GOMP_SPINCOUNT=spin`` (inf past ``timeout_s``)."""
    env = dict(os.environ, GOMP_SPINCOUNT=str(spin))
    hog = subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True) if busy else None
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--child", workload, "--model", model_dir],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=timeout_s,
        ).stdout
    except subprocess.TimeoutExpired:
        return float("inf")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["spin"] == str(spin)
    return float(result["value"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("SAO_REAL_MODEL", ""))
    ap.add_argument("--spins", default="1000,5000,10000,300000")
    ap.add_argument("--no-busy", action="store_true", help="quiet machine only")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per child")
    ap.add_argument("--child", choices=("train", "decode"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model)
        return
    spins = [int(s) for s in args.spins.split(",")]
    workloads = ["train"] + (["decode"] if args.model else [])
    conditions = [False] + ([] if args.no_busy else [True])
    print(f"workloads: {', '.join(workloads)}; `sao` imported before torch in each child")
    head = "GOMP_SPINCOUNT".ljust(16) + "".join(
        f"{w + (' busy' if b else ' quiet'):>14}" for w in workloads for b in conditions
    )
    print(head + "\n" + "train: s for 30 steps; decode: ms per token (batch 1)")
    for spin in spins:
        cells = [
            measure(w, spin, args.model, b, args.timeout) for w in workloads for b in conditions
        ]
        text = [f"{c:.1f}" if c < float("inf") else f"> {args.timeout:.0f} s" for c in cells]
        print(str(spin).ljust(16) + "".join(f"{t:>14}" for t in text), flush=True)


if __name__ == "__main__":
    main()
