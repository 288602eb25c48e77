"""The shared client of the engines over HTTP, behind the same
:class:`~sao.rollout.engine.Engine` protocol as the embedded engine: the
session, errors, model identity checks, the per-token version rule and the
abort-and-resubmit loop. The servers' own routes are in
:mod:`~sao.rollout.remote.vllm_engine` (vLLM and ``sao serve``) and
:mod:`~sao.rollout.remote.sglang_engine` (SGLang).

Per-token versions. ``sao serve`` reports the version of every token. vLLM
and SGLang do not, so the client makes the version of every token known by
construction: a weight update is ``pause in abort mode -> reload -> set the
version -> reset the prefix cache -> resume``. The pause ends every in-flight
request at once with its tokens so far, all sampled by the old weights; the
client waits for the resume and submits the request again with those tokens
appended to its prompt, so its later tokens are sampled by the new weights.
Each request is thus sampled by one version, the one in force when it was
submitted, and the client tags its tokens with that version. One race is left:
a request still in transit when the pause reaches the server is queued there,
not aborted, and runs after the resume with the new weights; its answer looks
the same as one that finished just before the pause. So an answer that was not
aborted but overlapped a pause whose resume was already sent is sampled again
(``redrawn``): its version cannot be told. Worst case, per update, every
in-flight request is prefilled once more (the prefix cache is reset because
its keys belong to the old weights); a stop string that straddles the
boundary is missed (stop token ids are not affected).

Failures: a server that cannot be reached, answers 5xx or exceeds
``request_timeout_s`` raises :class:`EngineError` (the router then moves the
request to another engine). Start-up problems raise :class:`EngineSetupError`
with the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import aiohttp

from sao.rollout.remote.collective import WeightGroup
from sao.rollout.weights import BroadcastWeights, DiskWeights, WeightSource
from sao.types import Completion, CompletionFinish, SamplingParams

__all__ = ["EngineError", "EngineSetupError", "ModelIdentity"]

KEEPALIVE_S = 3.0
"""Seconds an idle connection stays in the client's pool: under the 5 s after
which vLLM's server (uvicorn) closes it."""


class EngineError(RuntimeError):
    """A rollout server failed while serving (unreachable, 5xx, timed out)."""


class EngineSetupError(RuntimeError):
    """A rollout server cannot be used; the message says why and how to fix it."""


@dataclass(frozen=True)
class ModelIdentity:
    """What the trainer's model is, to refuse a server serving another one."""

    path: str
    vocab_size: int
    model_type: str
    num_hidden_layers: int
    hidden_size: int

    @classmethod
    def from_config(cls, path: str | Path, config: Any) -> ModelIdentity:
        return cls(
            str(path),
            int(config.vocab_size),
            str(config.model_type),
            int(getattr(config, "num_hidden_layers", 0) or 0),
            int(getattr(config, "hidden_size", 0) or 0),
        )

    def mismatch(self, other: ModelIdentity) -> list[str]:
        """Fields that differ, as ``name: ours vs theirs``."""
        out = []
        for name in ("vocab_size", "model_type", "num_hidden_layers", "hidden_size"):
            a, b = getattr(self, name), getattr(other, name)
            if a and b and a != b:
                out.append(f"{name} {a} vs {b}")
        return out


@dataclass
class _Part:
    """One server response: tokens, log-probs, optional per-token versions."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int] | None
    finish: str  # stop | length | abort


class _HttpEngine:
    """Shared client logic: session, version tagging, abort-and-resubmit."""

    kind = "http"

    def __init__(
        self,
        url: str,
        *,
        version: int = 0,
        request_timeout_s: float = 600.0,
        max_seq_len: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._version = version
        self.request_timeout_s = request_timeout_s
        if max_seq_len is not None:
            self.max_seq_len = max_seq_len
        self.model_name = ""
        self._session: aiohttp.ClientSession | None = None
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._epoch = 0  # bumped by every pause this client causes
        self._resumed = 0  # the epoch of the newest pause whose resume was sent
        self.resubmitted = 0  # requests sent again after a pause aborted them
        self.redrawn = 0  # answers sampled again because their version is unknown
        self.last_update_s = 0.0

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> int:
        return self._version

    @property
    def weight_sources(self) -> tuple[type, ...]:
        return (DiskWeights,)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        """Sample a continuation; resubmits across this client's own pauses."""
        prompt = [int(t) for t in prompt_ids]
        tokens: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        while True:
            await self._unpaused.wait()
            epoch, version = self._epoch, self._version
            left = sampling.max_new_tokens - len(tokens)
            seed = None if sampling.seed is None else sampling.seed + 7919 * len(tokens)
            params = replace(sampling, max_new_tokens=left, seed=seed)
            part = await self._complete(prompt + tokens, params)
            if part.versions is None and part.finish != "abort" and self._resumed > epoch:
                self.redrawn += 1  # finished before the pause, or queued and run after it
                continue
            tokens += part.token_ids
            logps += part.logprobs
            versions += part.versions or [version] * len(part.token_ids)
            ours = part.finish == "abort" and (epoch != self._epoch or not self._unpaused.is_set())
            if ours and len(tokens) < sampling.max_new_tokens:
                self.resubmitted += 1
                continue
            finish: CompletionFinish = (
                "aborted"
                if part.finish == "abort"
                else "stop"
                if part.finish == "stop"
                else "length"
            )
            if ours:  # the budget ran out exactly at the pause
                finish = "length"
            return Completion(tuple(tokens), tuple(logps), tuple(versions), finish)

    @property
    def supports_broadcast(self) -> bool:
        """True when the server can join a weight-transfer group (BroadcastWeights)."""
        return False

    keeps_versions = False
    """True when the server reports per-token versions, so an update needs no pause."""

    async def update_weights(self, source: WeightSource) -> None:
        """Pause (abort in-flight), load ``source``, resume. A
        :class:`BroadcastWeights` is received while the trainer sends it."""
        if isinstance(source, BroadcastWeights):
            group = cast(WeightGroup, source.group)
            sends = [asyncio.to_thread(group.send, source.state_dict)] if source.send else []
            await asyncio.gather(self.receive_broadcast(source), *sends)
            return
        if not isinstance(source, DiskWeights):
            raise TypeError(
                f"{type(self).__name__} takes DiskWeights or BroadcastWeights, "
                f"not {type(source).__name__}"
            )
        if self.keeps_versions:  # in-flight requests go on; their tokens carry exact versions
            await self._reload(source)
            self._version = source.version
        else:
            await self._paused(self._reload(source), source.version)

    async def receive_broadcast(self, source: BroadcastWeights) -> None:
        """This server's half of a broadcast (the trainer sends concurrently)."""
        if not self.supports_broadcast:
            raise EngineSetupError(
                f"{self.kind} server {self.url} cannot receive broadcast weights; use "
                "rollout.weight_transfer=disk"
            )
        if self.keeps_versions:
            await self._receive(source)
            self._version = source.version
        else:
            await self._paused(self._receive(source), source.version)

    async def join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        """Ask the server to join ``group`` as rank ``rank_offset`` (the trainer
        opens it concurrently)."""
        if not self.supports_broadcast:
            raise EngineSetupError(
                f"{self.kind} server {self.url} cannot join a weight-transfer group; use "
                "rollout.weight_transfer=disk"
            )
        await self._join(group, rank_offset)

    async def _paused(self, load: Awaitable[None], version: int) -> None:
        t0 = time.perf_counter()
        self._epoch += 1
        self._unpaused.clear()
        try:
            await self._pause()
            await load
            self._version = version
        finally:
            self._resumed = self._epoch
            with contextlib.suppress(EngineError):
                await self._resume()
            self._unpaused.set()
        self.last_update_s = time.perf_counter() - t0

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ http

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
            # Reuse a pooled connection only while the server surely keeps it open:
            # vLLM's uvicorn closes idle ones after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE),
            # aiohttp keeps them 15 s, and a request written into a closed one fails
            # ("Can not write request body"; seen when a real model's forward kept the
            # event loop busy between two requests).
            connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    async def _call(
        self,
        method: str,
        route: str,
        body: dict[str, Any] | None = None,
        *,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, Any]:
        """One request; returns (status, parsed JSON or text). Network failures
        and timeouts raise :class:`EngineError`."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.request_timeout_s)
        try:
            async with self.session().request(
                method, self.url + route, json=body, params=params, timeout=timeout
            ) as resp:
                text = await resp.text()
                try:
                    data: Any = json.loads(text) if text else None
                except json.JSONDecodeError:
                    data = text
                return resp.status, data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            raise EngineError(
                f"{self.kind} server {self.url} failed on {route}: {type(err).__name__}: {err}"
            ) from err

    async def _ok(
        self, method: str, route: str, body: dict[str, Any] | None = None, **kw: Any
    ) -> Any:
        status, data = await self._call(method, route, body, **kw)
        if status >= 500:
            raise EngineError(
                f"{self.kind} server {self.url}{route} answered {status}: {data!r:.300}"
            )
        if status >= 400:
            raise EngineSetupError(
                f"{self.kind} server {self.url}{route} refused the request "
                f"({status}): {data!r:.300}"
            )
        return data

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200, or raise EngineSetupError."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                status, data = await self._call("GET", "/health", timeout_s=5.0)
                if status == 200:
                    return
                last = f"status {status}: {data!r:.200}"
            except EngineError as err:
                last = str(err)
            await asyncio.sleep(0.5)
        raise EngineSetupError(
            f"{self.kind} server {self.url} did not become healthy within {timeout_s:.0f} s "
            f"(last: {last}); check that it is running and the URL is right "
            "(rollout.servers), or raise rollout.server_timeout_s"
        )

    # ------------------------------------------------------------------ per server

    async def connect(self, identity: ModelIdentity | None, timeout_s: float = 30.0) -> None:
        raise NotImplementedError

    async def _complete(self, prompt: list[int], sampling: SamplingParams) -> _Part:
        raise NotImplementedError

    async def _pause(self) -> None:
        raise NotImplementedError

    async def _reload(self, source: DiskWeights) -> None:
        raise NotImplementedError

    async def _resume(self) -> None:
        raise NotImplementedError

    async def _join(self, group: WeightGroup, rank_offset: int) -> None:
        raise NotImplementedError

    async def _receive(self, source: BroadcastWeights) -> None:
        raise NotImplementedError


def _local_identity(root: str) -> ModelIdentity | None:
    """The identity of a model directory the server names, when it is readable here."""
    config = Path(root) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    text = data.get("text_config", data)
    return ModelIdentity(
        root,
        int(text.get("vocab_size", 0) or 0),
        str(data.get("model_type", "")),
        int(text.get("num_hidden_layers", 0) or 0),
        int(text.get("hidden_size", 0) or 0),
    )


def _refuse_mismatch(kind: str, url: str, ours: ModelIdentity, theirs: ModelIdentity) -> None:
    diff = ours.mismatch(theirs)
    if diff:
        raise EngineSetupError(
            f"{kind} server {url} serves another model: it serves {theirs.path!r}, the "
            f"trainer's policy is {ours.path!r} ({'; '.join(diff)}). Start the server on the "
            "policy checkpoint (or point rollout.servers at the right server)"
        )
