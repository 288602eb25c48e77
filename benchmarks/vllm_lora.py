"""Does vLLM's CPU build serve LoRA adapters through its own routes, and how
exactly? The question issue-level LoRA support asks before it chooses how
adapters reach vLLM.

Starts one vLLM server on SmolLM2-135M as ``rollout.launch`` does, plus
``--enable-lora``; saves a rank-8 adapter on q_proj and v_proj (B drawn at
random, so it moves the model) in peft's format; loads it at run time
(``POST /v1/load_lora_adapter``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), samples
through it and compares the log-probabilities vLLM returns with the
trainer's on the merged model (float32). A second adapter under a new name
stands for the next policy version. Prints what worked, the largest
log-probability gap, and the time of each load.

    SAO_VLLM_PYTHON=... PYTHONPATH=. python benchmarks/vllm_lora.py
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from benchmarks.run_memory import cpu_model
from sao.models.fetch import resolve_model_path
from sao.models.loading import load_policy, load_tokenizer
from sao.models.logprobs import sequence_logprobs
from sao.models.lora import add_lora, merged_copy, save_adapter
from sao.rollout.remote.launch import launch_servers

QUESTIONS = ("What is 7 + 5?", "Name a colour.", "Say hello.")


def adapter(path: Path, seed: int) -> torch.nn.Module:
    """The policy with a random rank-8 adapter on q and v, saved to ``path``."""
    policy = load_policy(resolve_model_path("smollm2-135m"))
    add_lora(policy, rank=8, alpha=16.0, targets=["q_proj", "v_proj"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    save_adapter(policy, path, base=str(resolve_model_path("smollm2-135m")))
    return policy


async def compare(
    http: aiohttp.ClientSession,
    url: str,
    name: str,
    policy: torch.nn.Module,
    base_model: torch.nn.Module,
    prompts: list[list[int]],
) -> tuple[float, float]:
    """Sample each prompt through adapter ``name``; the largest gap between the
    log-probabilities vLLM returns and the merged model's, and the base model's."""
    merged = merged_copy(policy).eval()
    gap = moved = 0.0
    for prompt in prompts:
        body = {
            "model": name,
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 1.0,
            "seed": 1,
            "logprobs": 0,
            "return_token_ids": True,
        }
        async with http.post(url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            choice = (await r.json())["choices"][0]
        served = torch.tensor(choice["logprobs"]["token_logprobs"])
        seq = torch.tensor([prompt + choice["token_ids"]])
        with torch.no_grad():
            ours = sequence_logprobs(merged, seq, torch.ones_like(seq))[0, len(prompt) :]
            plain = sequence_logprobs(base_model, seq, torch.ones_like(seq))[0, len(prompt) :]
        gap = max(gap, float((ours - served).abs().max()))
        moved = max(moved, float((plain - served).abs().max()))
    return gap, moved


async def main() -> None:
    base = resolve_model_path("smollm2-135m")
    tok = load_tokenizer(base)
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
    print(f"SmolLM2-135M, vLLM at {os.environ['SAO_VLLM_PYTHON']}; CPU: {cpu_model()}")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policies = {f"v{k}": adapter(root / f"v{k}", seed=k) for k in (1, 2)}
        base_model = load_policy(base).eval()
        extra = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
        try:
            async with (
                launch_servers(
                    "vllm",
                    str(base),
                    1,
                    log_dir=root,
                    timeout_s=600,
                    python=os.environ["SAO_VLLM_PYTHON"],
                    max_seq_len=512,
                    max_batch_size=8,
                    dtype="float32",
                    device="cpu",
                    extra=extra,
                ) as (server,),
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
            ):
                for name, policy in policies.items():
                    start = time.perf_counter()
                    async with http.post(
                        server.url + "/v1/load_lora_adapter",
                        json={"lora_name": name, "lora_path": str(root / name)},
                    ) as resp:
                        text = await resp.text()
                    print(
                        f"load {name}: HTTP {resp.status} in "
                        f"{time.perf_counter() - start:.2f} s: {text[:200]}"
                    )
                    if resp.status != 200:
                        continue
                    gap, moved = await compare(http, server.url, name, policy, base_model, prompts)
                    print(
                        f"  {name}: max |log-prob gap| against the merged model {gap:.2e}, "
                        f"against the base model {moved:.2e} (what the adapter moves)"
                    )
        except Exception as err:  # the point is to report what the CPU build does
            print(f"vLLM with --enable-lora failed: {type(err).__name__}: {str(err)[-1500:]}")


if __name__ == "__main__":
    asyncio.run(main())
