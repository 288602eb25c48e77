"""The engine thread's state for :class:`sao.rollout.embedded.engine.TorchEngine`:
requests, KV slots, continuous batching, prefix reuse, sampling and weight
application.

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

from sao.rollout.embedded.kv_forward import CachedForward
from sao.rollout.embedded.sampling import StopStringMatcher, sample_tokens, sampling_logprobs
from sao.types import Completion, CompletionFinish, SamplingParams

_U_MAX = 1.0 - 2.0**-24  # largest float32 below 1: keeps u * cdf[-1] < cdf[-1]
# A parked cache that a new prompt extends is always reused; one it only shares
# a beginning with is copied from when they share at least this many tokens.
MIN_PARTIAL_REUSE = 16


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
    kv_epoch: int = 0  # weight epoch of the oldest keys in this request's cache


@dataclass(eq=False)
class CachedPrefix:
    """A finished request's KV slot, parked for a later prompt that starts with
    ``tokens``: the ids at the cache's positions ``0..len-1`` (the prompt and
    every generated token but the last, which was never fed), written by the
    weights of ``epoch``; ``used`` orders parked slots for LRU eviction."""

    tokens: tuple[int, ...]
    epoch: int
    used: int


@dataclass(eq=False)
class WeightUpdate:
    """A pending ``update_weights`` call; ``done`` is set once it was applied."""

    state_dict: Mapping[str, torch.Tensor]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slice compares
    run in C; a mismatch costs a binary search of O(log n) of them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


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
    """Continuous batching over ``max_batch_size`` KV slots, with prefix reuse.

    Each :meth:`step` drops cancelled requests, admits waiting ones into slots
    (one batched prefill, then their first token is sampled), and runs one
    batched decode step over every running request; finished requests leave at
    once.

    Prefix reuse: a request that finishes with ``stop`` or ``length`` parks its
    slot with the tokens its cache holds (:class:`CachedPrefix`), up to
    ``max_cached_prefixes`` parked slots (0 turns reuse off). A new prompt that
    extends a parked cache takes that slot and prefills only its new tokens; one
    that shares at least :data:`MIN_PARTIAL_REUSE` leading tokens with a parked
    cache gets a copy of those positions in its own slot (the parked cache
    stays). The last prompt token is always prefilled, for its logits. Parked
    slots are evicted least recently used first when a request needs a slot and
    none is free. A weight update drops every parked cache, and a request whose
    cache holds keys of older weights is not parked, unless
    ``reuse_stale_prefix``.
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
        max_cached_prefixes: int = 0,
        reuse_stale_prefix: bool = False,
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
        self.max_cached_prefixes = max_cached_prefixes
        self.reuse_stale_prefix = reuse_stale_prefix
        self.parked: dict[int, CachedPrefix] = {}
        self.epoch = 0  # counts weight updates, so equal version numbers cannot alias
        self.prefill_tokens = 0  # prompt tokens fed by admission prefills
        self.reused_tokens = 0  # prompt tokens whose cache was reused instead
        self._clock = 0  # for CachedPrefix.used

    def step(self) -> None:
        """One loop iteration: drop cancelled, admit and prefill, decode one token."""
        for req in [r for r in self.running.values() if r.cancelled]:
            self._release(req)  # not parked: its episode is over
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
        """Move waiting requests into slots, prefill them together (up to
        ``max_prefill_tokens`` padded new tokens), each on top of the prefix it
        reuses, then sample their first token."""
        batch: list[Request] = []
        starts: list[int] = []
        longest = 0
        while self.waiting:
            req = self.waiting[0]
            src, reuse = self._match(req.prompt)
            n = len(req.prompt) - reuse
            if batch and (len(batch) + 1) * max(longest, n) > self.max_prefill_tokens:
                break
            epoch = self.epoch if src is None else self.parked[src].epoch
            slot = self._claim(src, reuse)
            if slot is None:
                break
            self.waiting.popleft()
            req.slot, req.kv_epoch = slot, epoch
            self.running[slot] = req
            batch.append(req)
            starts.append(reuse)
            longest = max(longest, n)
            self.prefill_tokens += n
            self.reused_tokens += reuse
        if batch:
            seqs = [r.prompt[start:] for r, start in zip(batch, starts, strict=True)]
            logits_NV = self.forward.prefill([r.slot for r in batch], seqs, starts)
            self._sample(batch, logits_NV)

    def _match(self, prompt: tuple[int, ...]) -> tuple[int | None, int]:
        """The parked slot whose cache shares the longest prefix with ``prompt``
        and how many of its positions to reuse (at most ``len(prompt) - 1``);
        ``(None, 0)`` when none qualifies (see the class docstring). Ties go to a
        cache the prompt extends, then to the most recently used."""
        best: tuple[int, bool, int] = (0, False, -1)
        best_slot = None
        for slot, entry in self.parked.items():
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            whole = n == len(entry.tokens)
            if not whole and n < MIN_PARTIAL_REUSE:
                continue
            key = (n, whole, entry.used)
            if key > best:
                best, best_slot = key, slot
        return best_slot, best[0]

    def _claim(self, src: int | None, reuse: int) -> int | None:
        """A slot for a request reusing ``reuse`` positions of parked slot
        ``src`` (None: no reuse), holding that prefix; None when every slot runs.

        A cache the prompt extends is taken over. Otherwise the request gets a
        free slot, or evicts the least recently used other parked slot, and
        copies the prefix there; with neither, it takes ``src`` over."""
        if src is not None and reuse == len(self.parked[src].tokens):
            del self.parked[src]
            return src
        slot = heapq.heappop(self.free_slots) if self.free_slots else self._evict(src)
        if slot is None:
            if src is not None:
                del self.parked[src]
            return src
        if src is not None:
            self.forward.copy(src, slot, reuse)
            self.parked[src].used = self._tick()
        return slot

    def _evict(self, keep: int | None) -> int | None:
        """Unpark the least recently used parked slot other than ``keep``."""
        others = [s for s in self.parked if s != keep]
        if not others:
            return None
        slot = min(others, key=lambda s: self.parked[s].used)
        del self.parked[slot]
        return slot

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _compact(self) -> None:
        """Keep the running requests in slots ``0..n-1``, so the decode step
        (which runs over the slot range ``[0, max slot]``) computes no idle or
        parked rows: the request in the highest slot moves into the lowest slot
        that is not running; a free one simply takes it (one cache copy), a
        parked one swaps with it (both caches copied once)."""
        while self.running and max(self.running) >= len(self.running):
            high = max(self.running)
            low = next(s for s in range(len(self.running)) if s not in self.running)
            req = self.running.pop(high)
            length = len(req.prompt) + len(req.tokens) - 1
            entry = self.parked.pop(low, None)
            if entry is None:  # low is free, and the lowest free slot
                heapq.heappop(self.free_slots)
                self.forward.move(high, low, length)
                heapq.heappush(self.free_slots, high)
            else:
                self.forward.swap(high, low, max(length, len(entry.tokens)))
                self.parked[high] = entry
            req.slot = low
            self.running[low] = req

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

    def _release(self, req: Request, *, park: bool = False) -> None:
        """Take the request out of its slot; park the slot (evicting the least
        recently used parked slot beyond ``max_cached_prefixes``) or free it."""
        if req.slot < 0:
            return
        slot, req.slot = req.slot, -1
        del self.running[slot]
        fresh = self.reuse_stale_prefix or req.kv_epoch == self.epoch
        if not (park and fresh and self.max_cached_prefixes > 0):
            self._free(slot)
            return
        while len(self.parked) >= self.max_cached_prefixes:
            self._free(min(self.parked, key=lambda s: self.parked[s].used))
        tokens = req.prompt + tuple(req.tokens[:-1])
        self.parked[slot] = CachedPrefix(tokens, req.kv_epoch, self._tick())

    def _free(self, slot: int) -> None:
        self.parked.pop(slot, None)
        self.forward.release(slot)
        heapq.heappush(self.free_slots, slot)

    def drop_cached_prefixes(self) -> None:
        """Free every parked slot."""
        for slot in list(self.parked):
            self._free(slot)

    def finish(
        self, req: Request, reason: CompletionFinish, error: BaseException | None = None
    ) -> None:
        """Park or free the request's slot and resolve its future on its own loop."""
        self._release(req, park=error is None and reason in ("stop", "length"))
        result = Completion(tuple(req.tokens), tuple(req.logprobs), tuple(req.versions), reason)
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
            req.loop.call_soon_threadsafe(_settle, req.future, result, error)

    def finish_all(self, reason: CompletionFinish, error: BaseException | None = None) -> None:
        """Finish every running and waiting request (abort or failure); a
        failure also drops the parked caches, which it may have left half written."""
        for req in [*self.running.values(), *self.waiting]:
            self.finish(req, reason, error)
        self.waiting.clear()
        if error is not None:
            self.drop_cached_prefixes()

    def apply_update(self, update: WeightUpdate) -> None:
        """Copy new weights into the model in place, between two steps; drop
        the parked caches the old weights wrote (unless ``reuse_stale_prefix``)."""
        try:
            self.epoch += 1  # first: a half-applied update leaves no cache fresh
            if not self.reuse_stale_prefix:
                self.drop_cached_prefixes()
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
            for r in part:
                r.kv_epoch = self.epoch
