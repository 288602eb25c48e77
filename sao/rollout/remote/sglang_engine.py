"""SGLang's native server behind the :class:`~sao.rollout.engine.Engine`
protocol: ``/generate`` with ``input_ids``, paused and updated through its own
routes. The session, the per-token version rule and the abort-and-resubmit
loop are the shared HTTP client's (:mod:`sao.rollout.remote.http_engine`)."""

from __future__ import annotations

from typing import Any, cast

from sao.rollout.remote.collective import WeightGroup, describe
from sao.rollout.remote.http_engine import (
    EngineError,
    EngineSetupError,
    ModelIdentity,
    _HttpEngine,
    _local_identity,
    _Part,
    _refuse_mismatch,
)
from sao.rollout.weights import BroadcastWeights, DiskWeights
from sao.types import SamplingParams

__all__ = ["SGLangEngine"]


def _span_versions(spans: object, n: int) -> list[int] | None:
    """SGLang's ``weight_versions`` spans (``[{version, start, end}]``) as one
    version per token, when every version is one this client set (an int) and
    the spans cover the ``n`` tokens; None otherwise (the client's rule applies)."""
    if not isinstance(spans, list) or not spans:
        return None
    out: list[int] = []
    for span in spans:
        try:
            version, start, end = int(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            return None
        if start != len(out) or end < start:
            return None
        out += [version] * (end - start)
    return out if len(out) == n else None


class SGLangEngine(_HttpEngine):
    """SGLang's native server (``/generate`` with ``input_ids``)."""

    kind = "sglang"

    async def connect(self, identity: ModelIdentity | None, timeout_s: float = 30.0) -> None:
        await self.wait_ready(timeout_s)
        info = await self._ok("GET", "/model_info") or {}
        self.model_name = str(info.get("model_path", ""))
        if identity is not None:
            theirs = _local_identity(self.model_name)
            if theirs is not None:
                _refuse_mismatch(self.kind, self.url, identity, theirs)
        if "weight_version" not in info:
            raise EngineSetupError(
                f"sglang server {self.url} reports no weight_version on /model_info: use an "
                "SGLang release with in-flight weight updates (0.5 or later)"
            )

    async def _complete(self, prompt: list[int], sampling: SamplingParams) -> _Part:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if sampling.stop_token_ids:  # (seeds need --enable-deterministic-inference: not sent)
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.stop_strings:
            params["stop"] = list(sampling.stop_strings)
        body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        data = await self._ok("POST", "/generate", body)
        try:
            meta = data["meta_info"]
            out = meta.get("output_token_logprobs") or []
            logps = [float(x[0]) for x in out]
            ids = [int(x[1]) for x in out]
            reason = meta.get("finish_reason") or {}
            finish = str(reason.get("type", "length") if isinstance(reason, dict) else reason)
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise EngineError(
                f"sglang server {self.url}: unexpected response {data!r:.300}"
            ) from err
        return _Part(ids, logps, None, finish)

    @property
    def supports_broadcast(self) -> bool:
        return True

    @property
    def weight_sources(self) -> tuple[type, ...]:
        return (DiskWeights, BroadcastWeights)

    async def _join(self, group: WeightGroup, rank_offset: int) -> None:
        body = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
            "group_name": group.group_name,
            "backend": group.backend,
        }
        await self._checked("/init_weights_update_group", body, EngineSetupError, "could not join")

    async def _receive(self, source: BroadcastWeights) -> None:
        info = describe(source.state_dict)
        body = {
            "names": info["names"],
            "dtypes": info["dtype_names"],
            "shapes": info["shapes"],
            "group_name": cast(WeightGroup, source.group).group_name,
            "weight_version": str(source.version),
            "flush_cache": True,
        }
        await self._checked(
            "/update_weights_from_distributed", body, EngineError, "failed to receive weights"
        )

    async def _checked(
        self, route: str, body: dict[str, Any], error: type[Exception], what: str
    ) -> None:
        """POST ``body`` to ``route``; an answer with ``success: false`` raises
        ``error`` ("sglang server URL WHAT: ANSWER")."""
        data = await self._ok("POST", route, body)
        if isinstance(data, dict) and data.get("success") is False:
            raise error(f"sglang server {self.url} {what}: {data}")

    async def _pause(self) -> None:
        await self._ok("POST", "/pause_generation", {"mode": "abort"})

    async def _reload(self, source: DiskWeights) -> None:
        body = {
            "model_path": str(source.path),
            "weight_version": str(source.version),
            "abort_all_requests": True,
        }
        await self._checked(
            "/update_weights_from_disk", body, EngineError, f"failed to load {source.path}"
        )

    async def _resume(self) -> None:
        await self._ok("POST", "/continue_generation", {})
