"""The embedded torch rollout engine: continuous batching over a static KV
cache on a background thread, exact per-token log-probabilities and versions,
in-flight weight updates.

One dedicated thread owns the engine's private copy of the model and the KV
cache and runs the loop: apply pending weight updates, admit waiting requests
(batched prefill), one batched decode step over every running request, resolve
finished requests. ``generate`` only enqueues a request and awaits an asyncio
future that the thread resolves with ``loop.call_soon_threadsafe``, so any
number of event loops can share one engine, and since torch kernels release
the GIL, generation overlaps with environment and trainer work.

Decisions (see also :mod:`sao.rollout.embedded.sampling` and
:mod:`sao.rollout.embedded.kv_forward`):

- Context window: a prompt must leave room for at least one token
  (``len(prompt) < max_seq_len``) or ``generate`` raises ``ValueError``;
  ``max_new_tokens`` is clamped to the room left, and a request that fills the
  window finishes with ``"length"``. A multi-turn episode that outgrows the
  window thus ends like any other length-truncated episode.
- Stops: a stop token or stop string ends the request with ``"stop"``; the
  tokens that completed the match are kept in the completion (they were sampled
  and have log-probabilities), nothing is trimmed. With empty
  ``stop_token_ids`` the model's eos ids are used (:func:`default_stop_ids`).
- Seeds: each request draws its uniforms from its own ``random.Random(seed)``
  (one draw per token, turned into a token by inverting the CDF), so a seeded
  request gets the same tokens whatever else shares its batch, up to the
  floating-point differences of batched matmuls.
- Weight updates keep the KV cache of tokens already processed by default:
  recomputing it costs one prefill per in-flight request, and the trainer's DIS
  ratio uses the per-token log-probabilities the engine actually sampled with,
  which are exact either way. ``recompute_kv_on_update=True`` re-prefills
  every in-flight request with the new weights instead. With the cache kept, a
  token sampled after an update is conditioned on keys and values of earlier
  tokens computed by the weights in force when those tokens were processed.
- Prefix reuse across calls: a request that ends with ``"stop"`` or
  ``"length"`` leaves its KV slot parked with the tokens it holds (the prompt
  and the reply but its last token). A later prompt that extends a parked
  cache (the next turn of a multi-turn episode: history + reply +
  observation) takes the slot over and prefills only its new tokens; one that
  shares at least 16 leading tokens with a parked cache starts from a copy of
  them. Logits equal those of a full prefill up to float rounding. Parked
  slots are evicted least recently used first when a request needs a slot,
  and at most ``max_cached_prefixes`` are kept. A weight update drops them
  all, and a request whose cache mixes weights is not parked (as a server's
  ``reset_prefix_cache`` on update), unless ``reuse_stale_prefix=True``.
  Cancelled, aborted and failed requests free their slot. ``prefix_cache=False``
  turns reuse off, and the fallback forward below never reuses;
  ``prefill_tokens`` and ``reused_tokens`` count both kinds of prompt tokens.
- Architectures other than Llama, Qwen2, Qwen3 and Mistral run the model's own
  forward with one ``DynamicCache`` per request, one request at a time:
  correct, not batched, much slower.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, cast

import torch
from torch import nn

from sao.rollout.embedded.kv_forward import (
    CachedForward,
    DynamicCacheForward,
    StaticKVForward,
    supports_static_kv,
)
from sao.rollout.embedded.sampling import Detokenizer, StopStringMatcher, default_stop_ids
from sao.rollout.embedded.scheduler import Request, Scheduler, WeightUpdate
from sao.rollout.embedded.weight_book import WeightBook
from sao.rollout.openmp import release_team
from sao.rollout.weights import DiskWeights, TensorWeights, WeightSource, read_weights
from sao.types import Completion, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN_CAP = 4096


def _check_options(
    max_batch_size: int,
    max_prefill_tokens: int,
    max_cached_prefixes: int | None,
    *,
    reuse_stale_prefix: bool,
    recompute_kv_on_update: bool,
) -> None:
    """Refuse :class:`TorchEngine` options that cannot work, naming the option."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if max_prefill_tokens < 1:
        raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
    if max_cached_prefixes is not None and max_cached_prefixes < 0:
        raise ValueError(f"max_cached_prefixes must be >= 0, got {max_cached_prefixes}")
    if reuse_stale_prefix and recompute_kv_on_update:
        raise ValueError(
            "reuse_stale_prefix=True keeps caches of older weights, which "
            "recompute_kv_on_update=True exists to avoid; set one of them to False"
        )


class TorchEngine:
    """Embedded engine implementing :class:`sao.rollout.engine.Engine`.

    Args:
        model: a Hugging Face causal LM; the engine deep-copies it, so the
            caller's model (the trainer's) can change without racing the engine.
            Llama, Qwen2, Qwen3 and Mistral run the batched static-KV forward;
            any other architecture falls back to the model's own forward with a
            per-request ``DynamicCache`` (correct, one request at a time).
        max_batch_size: KV-cache slots, i.e. requests decoded together.
        max_seq_len: context window (prompt + generated tokens) and KV-cache
            length; None takes ``config.max_position_embeddings`` capped at
            4096 (pass it explicitly for longer contexts: the cache holds
            ``2 * layers * max_batch_size * kv_heads * max_seq_len * head_dim``
            values).
        device, dtype: where and in which dtype the engine's copy lives
            (None keeps the model's dtype). Logits processing is fp32 always.
        version: weight version of the initial model.
        tokenizer: needed for ``stop_strings``; also a source of eos ids.
        recompute_kv_on_update: re-prefill in-flight requests after a weight
            update instead of keeping the cache of earlier tokens.
        max_prefill_tokens: padded prompt tokens prefilled together in one call.
        prefix_cache: keep finished requests' KV slots for later prompts that
            start with the same tokens (see the module docstring).
        max_cached_prefixes: most parked slots; None = ``max_batch_size``.
        reuse_stale_prefix: keep parked caches across weight updates, so a
            later turn may attend to keys of older weights (as the in-flight
            requests do by default); incompatible with
            ``recompute_kv_on_update``.
        step_callback: called on the engine thread after every loop step (for
            metrics and tests); it must be quick, and may call
            ``load_weights``, which then applies immediately.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        version: int = 0,
        tokenizer: Detokenizer | None = None,
        recompute_kv_on_update: bool = False,
        max_prefill_tokens: int = 8192,
        step_callback: Callable[[TorchEngine], None] | None = None,
        prefix_cache: bool = True,
        max_cached_prefixes: int | None = None,
        reuse_stale_prefix: bool = False,
    ) -> None:
        _check_options(
            max_batch_size,
            max_prefill_tokens,
            max_cached_prefixes,
            reuse_stale_prefix=reuse_stale_prefix,
            recompute_kv_on_update=recompute_kv_on_update,
        )
        self._model = cast(Any, copy.deepcopy(model).to(device=device, dtype=dtype).eval())
        self._model.requires_grad_(False)
        config = self._model.config
        self.max_seq_len = max_seq_len or min(
            int(getattr(config, "max_position_embeddings", 0) or DEFAULT_MAX_SEQ_LEN_CAP),
            DEFAULT_MAX_SEQ_LEN_CAP,
        )
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        self.max_batch_size = max_batch_size
        self.tokenizer = tokenizer
        self.vocab_size = int(self._model.get_input_embeddings().num_embeddings)
        generation_config = getattr(self._model, "generation_config", None)
        self.eos_token_ids = default_stop_ids(config, generation_config, tokenizer)
        self._init_scheduler(
            version=version,
            max_prefill_tokens=max_prefill_tokens,
            recompute_kv_on_update=recompute_kv_on_update,
            prefix_cache=prefix_cache,
            max_cached_prefixes=max_cached_prefixes,
            reuse_stale_prefix=reuse_stale_prefix,
        )
        self._step_callback = step_callback
        self._seed_source = random.Random()
        # Handed over to the engine thread under _cond.
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._updates: deque[WeightUpdate] = deque()
        self._abort_requested = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="sao-torch-engine", daemon=True)
        self._thread.start()
        release_team()  # copying the model made this thread an OpenMP team (see sao.rollout.openmp)

    def _init_scheduler(
        self,
        *,
        version: int,
        max_prefill_tokens: int,
        recompute_kv_on_update: bool,
        prefix_cache: bool,
        max_cached_prefixes: int | None,
        reuse_stale_prefix: bool,
    ) -> None:
        """Pick the forward (the batched static-KV one where the architecture
        has it) and build the scheduler over the engine's copy of the weights."""
        forward: CachedForward = (
            StaticKVForward(
                self._model, max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len
            )
            if supports_static_kv(self._model)
            else DynamicCacheForward(self._model)
        )
        self._book = WeightBook(self._model.state_dict())
        parked_cap = self.max_batch_size if max_cached_prefixes is None else max_cached_prefixes
        if not (prefix_cache and isinstance(forward, StaticKVForward)):
            parked_cap = 0  # the fallback forward cannot prefill on top of a prefix
        self._sched = Scheduler(
            forward,
            self._book.weights,
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            max_prefill_tokens=max_prefill_tokens,
            recompute_kv_on_update=recompute_kv_on_update,
            version=version,
            max_cached_prefixes=parked_cap,
            reuse_stale_prefix=reuse_stale_prefix,
        )

    @property
    def version(self) -> int:
        """Weight version in force for the next sampled token."""
        return self._sched.version

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the engine's weight copy (logits are processed in float32)."""
        return cast(torch.dtype, self._model.get_input_embeddings().weight.dtype)

    @property
    def uses_static_kv(self) -> bool:
        """True when the batched static-KV forward runs (else the slow fallback)."""
        return isinstance(self._sched.forward, StaticKVForward)

    @property
    def num_running(self) -> int:
        """Requests holding a KV slot (approximate when read from another thread)."""
        return len(self._sched.running)

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not yet admitted (approximate)."""
        return len(self._sched.waiting) + len(self._inbox)

    @property
    def steps(self) -> int:
        """Engine loop steps run so far (each decodes one token per running request)."""
        return self._sched.steps

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens prefilled so far (excluding re-prefills on weight updates)."""
        return self._sched.prefill_tokens

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV cache was reused from an earlier request instead."""
        return self._sched.reused_tokens

    @property
    def num_cached_prefixes(self) -> int:
        """Parked KV slots kept for prefix reuse (approximate from another thread)."""
        return len(self._sched.parked)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called and the engine thread has ended."""
        return self._closing and not self._thread.is_alive()

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        """Sample a continuation of ``prompt_ids``; see the module docstring.

        Cancelling the awaiting task removes the request from the batch and
        frees its slot before the next decode step.
        """
        req = self._make_request(prompt_ids, sampling)
        with self._cond:
            if self._closing:
                raise RuntimeError("TorchEngine is closed; create a new engine to generate")
            self._inbox.append(req)
            self._cond.notify()
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True
            raise

    @property
    def device(self) -> torch.device:
        """Where the engine's copy of the model lives."""
        return next(self._model.parameters()).device

    @property
    def weight_sources(self) -> tuple[type, ...]:
        """In-process tensors first; a weight directory also works."""
        return (TensorWeights, DiskWeights)

    async def update_weights(self, source: WeightSource) -> None:
        """Apply ``source`` between two decode steps (see :meth:`load_weights`);
        a :class:`DiskWeights` directory is read in a worker thread first."""
        if isinstance(source, TensorWeights):
            await asyncio.to_thread(self.load_weights, source.state_dict, source.version)
        elif isinstance(source, DiskWeights):
            state = await asyncio.to_thread(read_weights, source.path)
            await asyncio.to_thread(self.load_weights, state, source.version)
        else:
            raise TypeError(
                f"TorchEngine cannot apply a {type(source).__name__}; pass TensorWeights or "
                "DiskWeights"
            )

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` into the engine's weights between two decode steps.

        Keys must be names of the model's ``state_dict`` (a subset is allowed;
        other weights keep their values). Blocks until the engine thread has
        copied the tensors (at most one engine step), so the caller may modify
        them once this returns; from an event loop, ``await
        engine.update_weights(TensorWeights(...))`` keeps the loop free.
        Running requests continue; tokens sampled afterwards carry ``version``.
        """
        self._book.check(state_dict)
        self._apply(WeightUpdate(state_dict, version))
        self._book.replaced(state_dict)  # (their base weights are gone: see load_adapter)

    def load_adapter(
        self, tensors: Mapping[str, torch.Tensor], adapter: Mapping[str, Any], version: int
    ) -> None:
        """Apply LoRA factors between two decode steps: each adapted module's weight
        becomes ``W0 + scaling * B @ A`` (:func:`~sao.rollout.weights.merge_adapter`),
        ``W0`` its weight as the engine loaded it, kept aside at the first adapter
        update (the adapted modules' base weights, in memory once). ``tensors``:
        ``<module>.lora_A`` and ``<module>.lora_B``; ``adapter``: ``scaling`` by module
        and ``fan_in_fan_out`` (:func:`sao.models.lora.adapter_update`). A module
        whose weight a full update replaced has no base left: a ``ValueError``."""
        self._apply(WeightUpdate(self._book.merged(tensors, adapter), version))

    def _apply(self, update: WeightUpdate) -> None:
        """Hand ``update`` to the engine thread (or apply it, on that thread) and wait."""
        if threading.current_thread() is self._thread:
            self._sched.apply_update(update)
        else:
            with self._cond:
                if self._closing:
                    raise RuntimeError("TorchEngine is closed; load_weights needs a live engine")
                self._updates.append(update)
                self._cond.notify()
            update.done.wait()
        if update.error is not None:
            raise update.error

    def abort_all(self) -> None:
        """Finish every running and waiting request now with ``"aborted"``
        (their tokens so far are returned); the engine keeps serving."""
        with self._cond:
            self._abort_requested = True
            self._cond.notify()

    def close(self) -> None:
        """Abort every request, stop the engine thread and free the KV cache."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> TorchEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _make_request(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Request:
        """Validate a call and build its request (on the caller's thread)."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids is empty; pass at least one token id (e.g. a BOS token)")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(
                f"prompt_ids must lie in [0, {self.vocab_size}) (the model's vocabulary), "
                f"got min {min(prompt)} and max {max(prompt)}"
            )
        if len(prompt) >= self.max_seq_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room in the context window "
                f"(max_seq_len={self.max_seq_len}); shorten the prompt or build the engine "
                "with a larger max_seq_len"
            )
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError(
                "SamplingParams.stop_strings needs a tokenizer: pass tokenizer= to TorchEngine"
            )
        matcher = None
        if sampling.stop_strings and self.tokenizer is not None:
            matcher = StopStringMatcher(self.tokenizer, sampling.stop_strings)
        seed = sampling.seed if sampling.seed is not None else self._seed_source.getrandbits(64)
        loop = asyncio.get_running_loop()
        return Request(
            prompt=prompt,
            sampling=sampling,
            max_new=min(sampling.max_new_tokens, self.max_seq_len - len(prompt)),
            stop_ids=frozenset(sampling.stop_token_ids or self.eos_token_ids),
            rng=random.Random(seed),
            matcher=matcher,
            loop=loop,
            future=loop.create_future(),
        )

    def _has_work(self) -> bool:
        """True when the engine thread has something to do (called under ``_cond``)."""
        return bool(
            self._inbox
            or self._updates
            or self._abort_requested
            or self._closing
            or self._sched.running
            or self._sched.waiting
        )

    def _take_work(self) -> tuple[list[Request], list[WeightUpdate], bool, bool]:
        """Wait until there is something to do; hand over the queued work."""
        with self._cond:
            if not self._has_work():
                release_team()  # idle workers elsewhere slow every parallel region
                self._cond.wait_for(self._has_work)
            new, self._inbox = list(self._inbox), deque()
            updates, self._updates = list(self._updates), deque()
            abort = self._abort_requested or self._closing
            self._abort_requested = False
            return new, updates, abort, self._closing

    def _run(self) -> None:
        """The engine thread: updates, aborts, then one scheduler step, until closed."""
        torch.set_grad_enabled(False)
        try:
            while True:
                new, updates, abort, closing = self._take_work()
                self._sched.waiting.extend(new)
                while updates:  # popped: an applied update (a whole state dict) stays
                    self._sched.apply_update(updates.pop(0))  # referenced nowhere here
                if abort:
                    self._sched.finish_all("aborted")
                if closing:
                    break
                try:
                    self._sched.step()
                except Exception as exc:  # a failed step fails its requests, not the engine
                    logger.exception("TorchEngine step failed")
                    self._sched.finish_all("aborted", error=exc)
                if self._step_callback is not None:
                    try:
                        self._step_callback(self)
                    except Exception:
                        logger.exception("TorchEngine step_callback failed")
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """Fail whatever is still queued, refuse new work, free the KV cache."""
        stopped = RuntimeError("TorchEngine stopped")
        self._sched.finish_all("aborted", error=stopped)
        with self._cond:
            self._closing = True
            for req in self._inbox:
                self._sched.finish(req, "aborted", error=stopped)
            for update in self._updates:
                update.error = stopped
                update.done.set()
            self._inbox.clear()
            self._updates.clear()
        self._sched.forward.close()
