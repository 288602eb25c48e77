"""One actor forward and backward alone (no engine, no critic): how much the
live tensors rise (glibc's live heap, sampled every millisecond by a thread),
how much the resident memory rises (the kernel's high-water mark, reset first),
and what sao's estimate says of the same micro-batch. The gap between the
first two is the allocator's overhead inside a step.

    SAO_REAL_MODEL=$(sao models fetch smollm2-135m | tail -n 1) \
    PYTHONPATH=. python benchmarks/step_transient.py [--rows 16] [--tokens 152] [--ckpt]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

import sao  # noqa: F401  (its allocator defaults, before torch)
from sao.app.memory import LOGIT_CHUNK, saved_activation_bytes
from sao.models.checkpointing import checkpoint_layers
from sao.models.loading import load_policy
from sao.models.logprobs import sequence_logprobs
from sao.runtime.memory import GIB, MemoryMeter, _status_kib, heap_live


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("SAO_REAL_MODEL", ""))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=152)
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    args = ap.parse_args()
    if not args.model:
        ap.error("--model: the SmolLM2 directory `sao models fetch smollm2-135m` prints")
    model = load_policy(args.model, dtype=torch.float32, device=torch.device("cpu"))
    layers = model.config.num_hidden_layers
    if args.ckpt:
        checkpoint_layers(model)
    with torch.no_grad():
        for p in model.parameters():
            p.sum()  # the mapped weights resident before the baseline
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (args.rows, args.tokens), generator=g)
    mask = torch.ones_like(tokens)
    MemoryMeter()  # resets the high-water mark
    rss0, live0 = _status_kib("self", "VmRSS") * 1024, heap_live()
    peak, done = [live0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], heap_live())
            time.sleep(0.001)

    watcher = threading.Thread(target=sample)
    watcher.start()
    sequence_logprobs(model, tokens, mask).sum().backward()
    done.set()
    watcher.join()
    rss = _status_kib("self", "VmHWM") * 1024 - rss0
    grads = sum(
        p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
    )
    n = args.rows * args.tokens
    saved = saved_activation_bytes(model, args.rows, args.tokens)
    if args.ckpt:
        saved = saved // layers + layers * n * model.config.hidden_size * 4
    est = saved + 3 * min(n, LOGIT_CHUNK) * model.config.vocab_size * 4 + grads
    print(f"{args.rows} x {args.tokens} tokens, checkpointing {'on' if args.ckpt else 'off'}:")
    print(f"  live tensors rose   {(peak[0] - live0) / GIB:.2f} GiB (gradients {grads / GIB:.2f})")
    print(
        f"  resident rose       {rss / GIB:.2f} GiB ({rss / (peak[0] - live0):.2f}x the live rise)"
    )
    print(f"  estimate            {est / GIB:.2f} GiB (activations, logits, gradients)")


if __name__ == "__main__":
    main()
