"""Throughput of the embedded engine against Hugging Face ``generate``.

Same tiny Llama (~1M parameters: hidden 128, 4 layers, 4 heads, vocabulary
100), same prompts, same per-request ``max_new_tokens`` drawn log-uniformly
from [8, 256] (rollouts of very different lengths, as in agentic RL). Hugging
Face ``generate`` gets each batch of ``B`` requests left-padded and samples
until the longest request of the batch is done; the engine gets every request
at once with ``max_batch_size=B`` and refills a slot as soon as a request
finishes. Each batch size serves ``max(B, 128)`` requests (``--quick``: 64).
Throughput counts only the tokens each request asked for. Both run on one
torch CPU thread by default (``--threads``), which avoids oversubscription on
small shared machines.

    PYTHONPATH=. python benchmarks/engine.py            # batch 16, 64, 256
    PYTHONPATH=. python benchmarks/engine.py --quick    # batch 16, 64; 64 requests each
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao.rollout.embedded.engine import TorchEngine
from sao.types import SamplingParams

VOCAB = 100


@dataclass(frozen=True)
class Workload:
    """Prompts and per-request token budgets for one batch size."""

    prompts: list[list[int]]
    max_new: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.max_new)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """The benchmark model: ~1M parameters, no eos (every request runs to its budget)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def make_workload(n: int, rng: random.Random, lo: int = 8, hi: int = 256) -> Workload:
    """``n`` prompts of 4-32 tokens; budgets log-uniform in [lo, hi]."""
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 32))] for _ in range(n)]
    max_new = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]
    return Workload(prompts, max_new)


@torch.no_grad()
def run_hf(model: LlamaForCausalLM, work: Workload, batch: int) -> float:
    """Seconds for HF ``generate`` over the workload in batches of ``batch``."""
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch):
        prompts = work.prompts[i : i + batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(work.max_new[i : i + batch]),
            pad_token_id=0,
        )
    return time.perf_counter() - start


def run_engine(model: LlamaForCausalLM, work: Workload, batch: int) -> float:
    """Seconds for the engine to serve every request of the workload concurrently."""
    width = max(len(p) for p in work.prompts) + max(work.max_new)
    with TorchEngine(model, max_batch_size=batch, max_seq_len=width) as engine:

        async def serve(prompts: list[list[int]], max_new: list[int]) -> int:
            calls = [
                engine.generate(p, SamplingParams(max_new_tokens=m))
                for p, m in zip(prompts, max_new, strict=True)
            ]
            return sum(len(c.token_ids) for c in await asyncio.gather(*calls))

        asyncio.run(serve(work.prompts[:4], [4] * 4))  # warm-up
        start = time.perf_counter()
        produced = asyncio.run(serve(work.prompts, work.max_new))
        elapsed = time.perf_counter() - start
    if produced != work.tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {work.tokens}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 16 and 64, 64 requests each")
    parser.add_argument("--batches", type=int, nargs="*", default=None, help="batch sizes")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per batch size (default max(B, 128))"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 avoids oversubscription)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = args.batches or ([16, 64] if args.quick else [16, 64, 256])
    torch.manual_seed(0)
    model = tiny_llama()
    params = sum(p.numel() for p in model.parameters())
    threads = torch.get_num_threads()
    print(f"model: tiny Llama, {params / 1e6:.2f}M parameters; torch threads {threads}")
    header = ("batch", "requests", "tokens", "HF tok/s", "engine tok/s", "ratio")
    print("{:>6} {:>8} {:>8} {:>10} {:>13} {:>6}".format(*header))
    for batch in batches:
        n = args.requests or max(batch, 64 if args.quick else 128)
        work = make_workload(n, random.Random(batch))
        hf_s = run_hf(model, work, batch)
        engine_s = run_engine(model, work, batch)
        hf_tps, engine_tps = work.tokens / hf_s, work.tokens / engine_s
        print(
            f"{batch:>6} {len(work.prompts):>8} {work.tokens:>8} {hf_tps:>10.0f} "
            f"{engine_tps:>13.0f} {engine_tps / hf_tps:>5.2f}x"
        )


if __name__ == "__main__":
    main()
