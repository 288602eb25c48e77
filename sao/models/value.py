"""The value model (critic): a causal-LM backbone plus a scalar head.

Initialised from the policy checkpoint (ALGORITHMS.md section 4 [paper]). The
head is ``nn.Linear(hidden, 1)`` kept in float32 whatever the backbone dtype,
with weight ``~ N(0, (1 / (hidden + 1))^2)`` and bias 0 [choice]: initial
values start near 0 (returns are centred on small rewards), yet the weight is
non-zero so the very first critic step already sends gradient into the
backbone (a zero head would block it for one step).

On disk (``save_pretrained``): the backbone as a transformers base model
(``config.json`` + ``model.safetensors``, loadable with ``AutoModel``), or for a
LoRA backbone its adapter in ``adapter/`` (peft's format), plus
``value_head.safetensors`` and ``value_head.json``. Written to a temporary
directory and renamed, so a crash never leaves a half-written critic.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Literal, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from sao.models.cache import atomic_dir
from sao.models.loading import ModelLoadError, load_config, load_policy
from sao.models.logprobs import run_backbone, validate_token_batch
from sao.models.lora import has_lora, load_adapter, save_adapter

__all__ = ["HEAD_CONFIG", "HEAD_FILE", "ValueModel"]

HEAD_FILE = "value_head.safetensors"
HEAD_CONFIG = "value_head.json"
LORA_DIR = "adapter"
"""Where a LoRA critic's adapter goes (its backbone is the base checkpoint's)."""


class ValueModel(nn.Module):
    """``V(tokens_<t)`` for every position: backbone hidden state -> scalar.

    ``forward(tokens_BT, attention_mask_BT) -> values_BT`` (float32 ``[B, T]``,
    0 at padding and at a row's first token). ``values_BT[b, t]`` is the value
    of the state in which token ``t`` was chosen, so it reads the hidden state
    at token ``t - 1``: the same one-position shift as the log-probabilities
    (ALGORITHMS.md: entry ``t`` describes token ``t``). GAE then gives token
    ``t`` the advantage ``r_t + gamma * V(s_next) - V(s_t)`` of *its own*
    choice; reading the hidden state at ``t`` itself would credit each token
    with the next token's choice.
    """

    def __init__(self, backbone: PreTrainedModel, value_head: nn.Linear | None = None) -> None:
        super().__init__()
        hidden = int(backbone.config.hidden_size)
        self.backbone = backbone
        if value_head is None:
            value_head = nn.Linear(hidden, 1, dtype=torch.float32)
            nn.init.normal_(value_head.weight, mean=0.0, std=1.0 / (hidden + 1))
            nn.init.zeros_(value_head.bias)
        if value_head.in_features != hidden or value_head.out_features != 1:
            raise ValueError(
                f"value_head must be Linear({hidden}, 1) for this backbone, got "
                f"Linear({value_head.in_features}, {value_head.out_features})"
            )
        self.value_head = value_head.to(device=backbone.device, dtype=torch.float32)

    @classmethod
    def from_policy(
        cls,
        policy: str | os.PathLike[str] | PreTrainedModel,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
        head_init: Literal["random", "zero"] = "random",
    ) -> ValueModel:
        """A critic initialised from a policy: a directory or a loaded model.

        A passed model is deep-copied (the critic never shares weights with
        the policy); ``dtype`` and ``device`` apply to a directory. The head
        init is deterministic for ``seed`` (module docstring); ``head_init="zero"``
        zeroes its weight too, so every value starts at 0.
        """
        if isinstance(policy, PreTrainedModel):
            backbone = cast(PreTrainedModel, copy.deepcopy(policy.base_model))
        elif isinstance(policy, (str, os.PathLike)):
            backbone = cast(
                PreTrainedModel, load_policy(policy, dtype=dtype, device=device).base_model
            )
        else:
            raise TypeError(
                f"policy must be a model directory or a PreTrainedModel, got {type(policy)}"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            critic = cls(backbone)
        if head_init == "zero":
            with torch.no_grad():
                critic.value_head.weight.zero_()
        return critic

    def forward(
        self, tokens_BT: torch.Tensor, attention_mask_BT: torch.Tensor, *, packed: bool = False
    ) -> torch.Tensor:
        """Values ``[B, T]`` (float32), 0 at padding positions. ``packed``: the
        backbone runs padding-free (:mod:`sao.models.packing`), same values."""
        mask_BT = validate_token_batch(tokens_BT, attention_mask_BT)
        hidden_BTH = run_backbone(self.backbone, tokens_BT, mask_BT, packed=packed)
        after_BT = self.value_head(hidden_BTH.float()).squeeze(-1)  # V(tokens <= t)
        values_BT = torch.zeros_like(after_BT)
        values_BT[:, 1:] = after_BT[:, :-1]  # V(tokens < t): the state token t was drawn in
        first_BT = mask_BT & ~torch.cat([mask_BT[:, :1] & False, mask_BT[:, :-1]], dim=1)
        return torch.where(mask_BT & ~first_BT, values_BT, torch.zeros_like(values_BT))

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write backbone + head to ``directory`` atomically; returns the path."""
        with atomic_dir(directory) as tmp:
            if has_lora(self.backbone):  # the adapter (peft format) and the trained norm
                save_adapter(self.backbone, tmp / LORA_DIR)
            else:
                self.backbone.save_pretrained(tmp)
            state = self.value_head.state_dict()
            head = {k: v.detach().cpu().contiguous() for k, v in state.items()}
            save_file(head, str(tmp / HEAD_FILE))
            meta = {"hidden_size": self.value_head.in_features, "dtype": "float32"}
            (tmp / HEAD_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        return Path(directory)

    def load_lora(self, directory: str | os.PathLike[str], base: str | os.PathLike[str]) -> None:
        """Load the adapter and head of a LoRA critic saved by :meth:`save_pretrained`
        into this one, whose backbone (loaded from ``base``) has the same adapter
        layout (:func:`sao.models.lora.add_lora`)."""
        path = Path(directory).expanduser()
        load_adapter(self.backbone, path / LORA_DIR, base)
        self.value_head.load_state_dict(load_file(str(path / HEAD_FILE)))

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> ValueModel:
        """Load a critic written by :meth:`save_pretrained` (local directory only)."""
        load_config(directory)  # clear errors for a missing dir / config.json
        path = Path(directory).expanduser()
        if not (path / HEAD_FILE).is_file():
            raise ModelLoadError(
                f"ValueModel.from_pretrained: {str(path)!r} has no {HEAD_FILE}, so it is not a "
                "saved value model. Fix: pass a directory written by ValueModel.save_pretrained, "
                "or build a new critic with ValueModel.from_policy(policy_dir)"
            )
        backbone = AutoModel.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
        state = load_file(str(path / HEAD_FILE))
        hidden = int(state["weight"].shape[1])
        head = nn.Linear(hidden, 1, dtype=torch.float32)
        head.load_state_dict(state)
        return cls(backbone, head)
