"""Engine tokens/s on a real checkpoint (SmolLM2-135M-Instruct): the embedded
engine with its options, Hugging Face ``generate`` and vLLM (CPU build), the
memory and compute bounds, and where a decode step's time goes.

Same fixed prompts (ChatML questions, 35-45 tokens) for all, greedy decoding,
exactly ``--new`` new tokens per request (eos ignored: the embedded engine
gets no stop ids, ``generate`` gets ``min_new_tokens``, vLLM ``ignore_eos``),
at batch 1 (one request at a time) and batch 32 (32 concurrent requests;
``generate`` gets them as one left-padded batch). Ratios are against vLLM when
it runs (``--vllm-python``, or ``$SAO_VLLM_PYTHON``, or the cached environment
of ``scripts/install-vllm-cpu.sh``), measured in this one run, and each
embedded variant's greedy replies are compared with vLLM's token for token.

The embedded variants (``--variants``): float32 (the default) and a bfloat16
weight copy (``rollout.engine_dtype``).

Bounds: a 512 MiB copy's bandwidth against the weight bytes a batch-1 step
must read, and the batch-32 GEMM work against a 2048^3 ``torch.mm``.
``--profile`` adds torch.profiler tables of the engine's decode step.

``sao`` is imported before torch, as the ``sao`` command does, so the embedded
engine runs with sao's OpenMP spin default; the vLLM server keeps its own.

    PYTHONPATH=. python benchmarks/engines_real.py [--model DIR] [--new 64] [--profile]
"""

from __future__ import annotations

import sao  # noqa: F401  (before torch: sao's GOMP_SPINCOUNT default, as in `sao`)

# isort: split
import argparse
import asyncio
import copy
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch

from benchmarks.trainer_step import gemm_rate
from sao.app.cpu import cpu_model
from sao.app.engines import VLLM_CPU_PYTHON
from sao.models.cache import sao_home
from sao.models.loading import load_policy, load_tokenizer
from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.embedded.kv_forward import StaticKVForward
from sao.rollout.remote.launch import launch_servers
from sao.types import SamplingParams

TOPICS = ["rain", "gravity", "a prime number", "photosynthesis", "a compiler", "the moon"]
TOPICS += ["an atom", "a river", "inflation", "a volcano", "music", "a bridge"]
BATCHES = (1, 32)


def prompts(tok: object, n: int) -> list[list[int]]:
    """``n`` fixed chat prompts (the template adds SmolLM2's system message)."""
    out = []
    for i in range(n):
        q = f"Explain {TOPICS[i % len(TOPICS)]} in {2 + i // len(TOPICS)} sentences."
        text = tok.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))  # type: ignore[operator]
    return out


Replies = list[tuple[int, ...]]
"""The token ids of each request's reply, in prompt order."""


VARIANTS: dict[str, dict[str, Any]] = {"embedded": {}, "embedded bf16": {"dtype": torch.bfloat16}}
"""The embedded engine's copies measured (``--variants``): float32 (the default,
exact) and bfloat16 (``rollout.engine_dtype``)."""


async def embedded(
    model: torch.nn.Module, ps: list[list[int]], b: int, new: int, **options: Any
) -> tuple[float, Replies]:
    """Tokens/s of the embedded engine, ``b`` requests in flight, and its replies."""
    engine = TorchEngine(model, max_batch_size=b, max_seq_len=256, **options)
    engine.eos_token_ids = ()  # no stop ids: every request runs ``new`` tokens
    sp = SamplingParams(top_k=1, max_new_tokens=new)
    try:
        warm = SamplingParams(top_k=1, max_new_tokens=4)
        await asyncio.gather(*(engine.generate(p, warm) for p in ps[:b]))
        t0 = time.perf_counter()
        outs = []
        for i in range(0, len(ps), b):
            outs += await asyncio.gather(*(engine.generate(p, sp) for p in ps[i : i + b]))
        wall = time.perf_counter() - t0
    finally:
        await engine.aclose()
    assert all(len(c.token_ids) == new for c in outs)
    return len(outs) * new / wall, [c.token_ids for c in outs]


def hf_generate(model: torch.nn.Module, ps: list[list[int]], b: int, new: int, pad: int) -> float:
    """Tokens/s of ``generate``, batches of ``b`` left-padded prompts."""
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    model.generate(torch.tensor([ps[0]]), max_new_tokens=4, do_sample=False, pad_token_id=pad)  # type: ignore[operator]
    t0 = time.perf_counter()
    for i in range(0, len(ps), b):
        rows = ps[i : i + b]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)  # type: ignore[operator]
        assert out.shape[1] == width + new
    return len(ps) * new / (time.perf_counter() - t0)


async def vllm(url: str, name: str, ps: list[list[int]], b: int, new: int) -> tuple[float, Replies]:
    """Tokens/s of a vLLM server, ``b`` concurrent ``/v1/completions`` requests,
    and its replies (token ids: ``return_tokens_as_token_ids``)."""
    body = dict(
        model=name, temperature=0.0, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True
    )

    async def one(s: aiohttp.ClientSession, p: list[int], n: int) -> tuple[int, ...]:
        async with s.post(
            url + "/v1/completions", json={**body, "prompt": p, "max_tokens": n}
        ) as r:
            r.raise_for_status()
            tokens = (await r.json())["choices"][0]["logprobs"]["tokens"]
            return tuple(int(t.removeprefix("token_id:")) for t in tokens)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        await one(s, ps[0], 4)
        t0 = time.perf_counter()
        replies: Replies = []
        for i in range(0, len(ps), b):
            replies += await asyncio.gather(*(one(s, p, new) for p in ps[i : i + b]))
        wall = time.perf_counter() - t0
    assert [len(r) for r in replies] == [new] * len(ps)
    return len(ps) * new / wall, replies


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes moved (read + written) per second by a ``mib`` MiB tensor copy, the
    best of ``repeats`` (STREAM's Copy, far larger than the caches)."""
    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads at least once: every distinct weight tensor
    (tied embeddings count once; the embedding row lookup is counted whole, as
    the tied LM head reads it all)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def same_replies(a: Replies, b: Replies) -> str:
    """``"64/64 requests equal"`` or where the first difference is."""
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    if first is None:
        return f"{equal}/{len(a)} requests token for token equal"
    at = next(j for j, (x, y) in enumerate(zip(a[first], b[first], strict=False)) if x != y)
    return f"{equal}/{len(a)} requests equal; request {first} differs from token {at}"


def profile_decode(
    model: torch.nn.Module, b: int, context: int = 48, dtype: torch.dtype | None = None
) -> str:
    """torch.profiler's operator table (self CPU time) of 5 decode steps of the
    embedded engine's forward, ``b`` rows at ``context`` cached positions."""
    copied = copy.deepcopy(model).to(dtype=dtype).requires_grad_(False)
    forward = StaticKVForward(copied, max_batch_size=b, max_seq_len=256)
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(10, 40000, (b, context), generator=gen).tolist()
    forward.prefill(range(b), seqs)
    slots, tokens = list(range(b)), [s[-1] for s in seqs]
    for i in range(3):  # warm-up
        forward.decode(slots, tokens, [context + i] * b)
    with torch.profiler.profile() as prof:
        for i in range(5):
            forward.decode(slots, tokens, [context + 3 + i] * b)
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


async def run(args: argparse.Namespace) -> dict[str, dict[int, float]]:
    tok, model = load_tokenizer(args.model), load_policy(args.model).eval()
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    variants = args.variants.split(",")
    results: dict[str, dict[int, float]] = {v: {} for v in variants}
    replies: dict[str, dict[int, Replies]] = {v: {} for v in variants}
    if not args.no_generate:
        results["HF generate"] = {}
    for b in BATCHES:
        ps = prompts(tok, max(b, args.min_requests))
        for v in variants:
            results[v][b], replies[v][b] = await embedded(model, ps, b, args.new, **VARIANTS[v])
            print(f"  batch {b}: {v} done", flush=True)
        if not args.no_generate:
            results["HF generate"][b] = hf_generate(model, ps, b, args.new, pad)
    py = args.vllm_python
    if py and Path(py).is_file():
        results["vLLM (CPU)"] = {}
        log_dir = Path(args.log_dir)
        async with launch_servers(
            "vllm", str(args.model), 1, log_dir=log_dir, timeout_s=600, python=py,
            max_seq_len=256, max_batch_size=max(BATCHES), dtype="float32", device="cpu",
        ) as (server,):  # fmt: skip
            async with aiohttp.ClientSession() as s, s.get(server.url + "/v1/models") as r:
                name = (await r.json())["data"][0]["id"]
            for b in BATCHES:
                ps = prompts(tok, max(b, args.min_requests))
                results["vLLM (CPU)"][b], theirs = await vllm(server.url, name, ps, b, args.new)
                for v in variants:
                    same = same_replies(replies[v][b], theirs)
                    print(f"  batch {b}, {v} greedy replies against vLLM's: {same}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("SAO_REAL_MODEL", ""))
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=4, help="requests served at batch 1")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    default_py = os.environ.get("SAO_VLLM_PYTHON") or str(sao_home() / VLLM_CPU_PYTHON)
    ap.add_argument("--vllm-python", default=default_py)
    ap.add_argument("--log-dir", default="/tmp/sao-engines-real")
    ap.add_argument("--no-generate", action="store_true", help="skip Hugging Face generate")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="embedded engine options")
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of a decode step")
    args = ap.parse_args()
    if not args.model:
        ap.error("--model: the SmolLM2 directory `sao models fetch smollm2-135m` prints")
    torch.set_num_threads(args.threads)
    results = asyncio.run(run(args))
    print(f"\nSmolLM2-135M-Instruct float32, greedy, {args.new} new tokens per request, ")
    ref = "vLLM (CPU)" if "vLLM (CPU)" in results else next(iter(results))
    print(f"{args.threads} torch threads; ratio = tokens/s / {ref}'s; CPU: {cpu_model()}")
    head = "engine".ljust(14) + "".join(
        f"{'B=' + str(b) + ' tok/s':>13}{'ratio':>7}" for b in BATCHES
    )
    print(head)
    for name, r in results.items():
        cells = "".join(f"{r[b]:>13.1f}{r[b] / results[ref][b]:>7.2f}" for b in BATCHES)
        print(name.ljust(14) + cells)
    model = load_policy(args.model).eval()
    bw, nbytes = copy_bandwidth(), weight_bytes(model)
    print(
        f"\nmemory: a 512 MiB copy moves {bw / 1e9:.1f} GB/s (read + written); the float32 "
        f"weights are {nbytes / 1e6:.0f} MB, so a batch-1 decode step needs >= "
        f"{1e3 * nbytes / bw:.1f} ms (bfloat16: half)"
    )
    flops_tok = (
        2 * sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
        + 2 * model.get_input_embeddings().weight.numel()
    )  # the tied LM head
    rate, big = gemm_rate(2048), max(BATCHES)
    print(
        f"compute: a 2048^3 float32 torch.mm runs {rate / 1e9:.1f} GFLOP/s; "
        f"{flops_tok / 1e6:.0f} MFLOP of GEMM work per token"
    )
    for v in args.variants.split(","):
        half = VARIANTS[v].get("dtype") == torch.bfloat16
        bound_ms = 1e3 * nbytes / bw / (2 if half else 1)
        ms_1, used = 1e3 / results[v][1], results[v][big] * flops_tok
        print(
            f"  {v}: batch 1 {ms_1:.1f} ms per token = {ms_1 / bound_ms:.2f}x its bound; "
            f"batch {big} {used / 1e9:.1f} GFLOP/s = {used / rate:.0%} of the float32 mm rate"
        )
    if args.profile:
        for v in args.variants.split(","):
            for b in BATCHES:
                print(f"\n{v}, one decode step at batch {b} (48 cached positions), 5 steps:")
                print(profile_decode(model, b, **VARIANTS[v]))


if __name__ == "__main__":
    main()
