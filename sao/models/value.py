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

import contextlib
import copy
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from sao.models.cache import atomic_dir
from sao.models.freeze import layer_stack
from sao.models.loading import ModelLoadError, load_config, load_policy
from sao.models.logprobs import run_backbone, validate_token_batch
from sao.models.lora import has_lora, load_adapter, save_adapter

__all__ = ["HEAD_CONFIG", "HEAD_FILE", "ValueModel"]

HEAD_FILE = "value_head.safetensors"
HEAD_CONFIG = "value_head.json"
LORA_DIR = "adapter"
"""Where a LoRA critic's adapter goes (its backbone is the base checkpoint's)."""


@dataclass
class _Trunk:
    """A frozen trunk's output for one input (:meth:`ValueModel.trunk_cache`)."""

    tokens_BT: torch.Tensor
    mask_BT: torch.Tensor
    packed: bool
    hidden: torch.Tensor


class _Replay(nn.Module):
    """Stands in for a frozen bottom layer while a cached trunk is replayed: the
    first returns the trunk's output, the others pass it on."""

    def __init__(self, hidden: torch.Tensor | None) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.hidden if self.hidden is not None else hidden_states


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
        self._trunks: list[_Trunk] | None = None  # set inside trunk_cache()
        self._trunk_layers = 0  # frozen_trunk(), taken when trunk_cache() is entered

    def frozen_trunk(self) -> int:
        """How many bottom decoder layers are frozen whole, with the embeddings
        below them (``algo.critic_train_layers``): their output depends on the
        tokens alone. 0 when any of them trains (frozen attention alone, LoRA)."""
        path, n = layer_stack(self.backbone)
        stack = cast(nn.ModuleList, self.backbone.get_submodule(path))
        below = self.backbone.get_input_embeddings()
        if any(p.requires_grad for p in below.parameters()):
            return 0
        frozen = 0
        for layer in stack[:n]:
            if any(p.requires_grad for p in layer.parameters()):
                break
            frozen += 1
        return frozen if frozen < n else 0

    @contextlib.contextmanager
    def trunk_cache(self) -> Iterator[None]:
        """Within it, a forward on tokens it already ran reuses the frozen
        trunk's output (:meth:`frozen_trunk`) and runs only the layers above it:
        one batch's K critic updates and its values compute the trunk once. The
        values are the same numbers (the top layers get the same input). Nothing
        is cached when no bottom layer is frozen, or when the layers do not
        return a plain tensor (then every forward runs whole)."""
        self._trunk_layers = self.frozen_trunk()
        if self._trunk_layers == 0:
            yield
            return
        self._trunks = []
        try:
            yield
        finally:
            self._trunks = None

    def _cached_trunk(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, packed: bool
    ) -> _Trunk | None:
        for t in self._trunks or ():
            same = t.packed == packed and t.tokens_BT.shape == tokens_BT.shape
            if same and torch.equal(t.tokens_BT, tokens_BT) and torch.equal(t.mask_BT, mask_BT):
                return t
        return None

    def _hidden(self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, packed: bool) -> torch.Tensor:
        """The backbone's last hidden states, through the trunk cache when it is on."""
        if self._trunks is None:
            return run_backbone(self.backbone, tokens_BT, mask_BT, packed=packed)
        path, _ = layer_stack(self.backbone)
        stack = cast(nn.ModuleList, self.backbone.get_submodule(path))
        n = self._trunk_layers
        hit = self._cached_trunk(tokens_BT, mask_BT, packed)
        if hit is None:
            seen: list[object] = []
            hook = stack[n - 1].register_forward_hook(lambda m, a, out: seen.append(out))
            try:
                hidden = run_backbone(self.backbone, tokens_BT, mask_BT, packed=packed)
            finally:
                hook.remove()
            if seen and isinstance(seen[-1], torch.Tensor):  # (a first packed forward
                # runs a check of packing before itself: the last output is this one's)
                trunk = _Trunk(tokens_BT.clone(), mask_BT.clone(), packed, seen[-1].detach())
                self._trunks.append(trunk)
            return hidden
        frozen = [stack[i] for i in range(n)]
        for i in range(n):
            stack[i] = _Replay(hit.hidden if i == 0 else None)
        try:
            return run_backbone(self.backbone, tokens_BT, mask_BT, packed=packed)
        finally:
            for i, layer in enumerate(frozen):
                stack[i] = layer

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
        hidden_BTH = self._hidden(tokens_BT, mask_BT, packed)
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
