"""The engine thread's state for :class:`sao.rollout.torch_engine.TorchEngine`:
requests, KV slots, continuous batching, sampling and weight application.

Everything here runs on the engine thread only, so nothing here takes a lock;
:class:`TorchEngine` hands requests and updates over through its own queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import random
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sao.rollout.kv_forward import CachedForward
from sao.rollout.sampling import StopStringMatcher, sample_tokens, sampling_logprobs
from sao.types import Completion, CompletionFinish, SamplingParams

_U_MAX = 1.0 - 2.0**-24  # largest float32 below 1: keeps u * cdf[-1] < cdf[-1]


@dataclass(eq=False)
class Request:
    """One generation call. ``max_new`` is ``max_new_tokens`` clamped to the
    room left in the context window; ``cancelled`` is set by the caller's loop."""

    prompt: tuple[int, ...]
    sampling: SamplingParams
    max_new: int
    stop_ids: frozenset[int]
    rng: random.Random
    matcher: StopStringMatcher | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Completion]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot: int = -1
    cancelled: bool = False


@dataclass(eq=False)
class WeightUpdate:
    """A pending ``update_weights`` call; ``done`` is set once it was applied."""

    state_dict: Mapping[str, torch.Tensor]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _settle(
    future: asyncio.Future[Completion], result: Completion, error: BaseException | None
) -> None:
    if future.done():  # cancelled by its caller
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Scheduler:
    """Continuous batching over ``max_batch_size`` KV slots.

    Each :meth:`step` drops cancelled requests, admits waiting ones into free
    slots (one batched prefill, then their first token is sampled), and runs one
    batched decode step over every running request; finished requests leave at
    once and their slots are reused in the next step.
    """

    def __init__(
        self,
        forward: CachedForward,
        weights: Mapping[str, torch.Tensor],
        *,
        max_batch_size: int,
        max_seq_len: int,
        max_prefill_tokens: int,
        recompute_kv_on_update: bool,
        version: int,
    ) -> None:
        self.forward = forward
        self.weights = weights
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.recompute_kv_on_update = recompute_kv_on_update
        self.version = version
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.free_slots = list(range(max_batch_size))
        self.steps = 0

    def step(self) -> None:
        """One loop iteration: drop cancelled, admit and prefill, decode one token."""
        for req in [r for r in self.running.values() if r.cancelled]:
            self._release(req)
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        self._admit()
        self._compact()
        if self.running:
            reqs = list(self.running.values())
            logits_NV = self.forward.decode(
                [r.slot for r in reqs],
                [r.tokens[-1] for r in reqs],
                [len(r.prompt) + len(r.tokens) - 1 for r in reqs],
            )
            self._sample(reqs, logits_NV)
        self.steps += 1

    def _admit(self) -> None:
        """Move waiting requests into free slots, prefill them together (up to
        ``max_prefill_tokens`` padded tokens), sample their first token."""
        batch: list[Request] = []
        longest = 0
        while self.waiting and self.free_slots:
            n = len(self.waiting[0].prompt)
            if batch and (len(batch) + 1) * max(longest, n) > self.max_prefill_tokens:
                break
            req = self.waiting.popleft()
            req.slot = heapq.heappop(self.free_slots)
            self.running[req.slot] = req
            batch.append(req)
            longest = max(longest, n)
        if batch:
            logits_NV = self.forward.prefill([r.slot for r in batch], [r.prompt for r in batch])
            self._sample(batch, logits_NV)

    def _compact(self) -> None:
        """Move the requests in the highest slots into lower free ones, so the
        running requests occupy slots ``0..n-1`` and the decode step (which
        runs over the slot range ``[0, max slot]``) computes no idle rows.
        Each move copies one request's cache once."""
        while self.free_slots and self.running:
            high = max(self.running)
            if self.free_slots[0] > high:
                return
            low = heapq.heappop(self.free_slots)
            req = self.running.pop(high)
            self.forward.move(high, low, len(req.prompt) + len(req.tokens) - 1)
            req.slot = low
            self.running[low] = req
            heapq.heappush(self.free_slots, high)

    def _sample(self, reqs: list[Request], logits_NV: torch.Tensor) -> None:
        """Sample one token per request from ``logits_NV`` [N, V], record it
        with its log-probability and the current version, finish on a stop."""
        dev = logits_NV.device
        temperature_N = torch.tensor([r.sampling.temperature for r in reqs], device=dev)
        top_k_N = torch.tensor([r.sampling.top_k for r in reqs], device=dev)
        top_p_N = torch.tensor([r.sampling.top_p for r in reqs], device=dev)
        u_N = torch.tensor([min(r.rng.random(), _U_MAX) for r in reqs], dtype=torch.float32)
        logp_NV = sampling_logprobs(logits_NV, temperature_N, top_k_N, top_p_N)
        token_N, logp_N = sample_tokens(logp_NV, u_N.to(dev))
        for req, token, logp in zip(reqs, token_N.tolist(), logp_N.tolist(), strict=True):
            req.tokens.append(token)
            req.logprobs.append(logp)
            req.versions.append(self.version)
            if token in req.stop_ids or (req.matcher is not None and req.matcher.push(token)):
                self.finish(req, "stop")
            elif len(req.tokens) >= req.max_new:
                self.finish(req, "length")

    def _release(self, req: Request) -> None:
        if req.slot >= 0:
            del self.running[req.slot]
            self.forward.release(req.slot)
            heapq.heappush(self.free_slots, req.slot)
            req.slot = -1

    def finish(
        self, req: Request, reason: CompletionFinish, error: BaseException | None = None
    ) -> None:
        """Free the request's slot and resolve its future on its own loop."""
        self._release(req)
        result = Completion(tuple(req.tokens), tuple(req.logprobs), tuple(req.versions), reason)
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
            req.loop.call_soon_threadsafe(_settle, req.future, result, error)

    def finish_all(self, reason: CompletionFinish, error: BaseException | None = None) -> None:
        """Finish every running and waiting request (abort or failure)."""
        for req in [*self.running.values(), *self.waiting]:
            self.finish(req, reason, error)
        self.waiting.clear()

    def apply_update(self, update: WeightUpdate) -> None:
        """Copy new weights into the model in place, between two steps."""
        try:
            with torch.no_grad():
                for name, tensor in update.state_dict.items():
                    self.weights[name].copy_(tensor)
            self.version = update.version
            if self.recompute_kv_on_update and self.running:
                self._recompute_kv()
        except Exception as exc:
            update.error = exc
        finally:
            update.done.set()

    def _recompute_kv(self) -> None:
        """Re-prefill every running request's cache with the current weights:
        its prompt and every generated token but the last, which the next
        decode step feeds."""
        reqs = list(self.running.values())
        chunk = max(1, self.max_prefill_tokens // self.max_seq_len)
        for i in range(0, len(reqs), chunk):
            part = reqs[i : i + chunk]
            seqs = [r.prompt + tuple(r.tokens[:-1]) for r in part]
            self.forward.prefill([r.slot for r in part], seqs)
