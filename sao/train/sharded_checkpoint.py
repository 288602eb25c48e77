"""Sharded trainer checkpoints with ``torch.distributed.checkpoint`` (DCP), the
Hugging Face export gathered to one directory, and a weight update gathered
to rank 0 (:func:`gathered_update`).

:func:`save_sharded` / :func:`load_sharded` are collective (every rank calls
them); each rank writes and reads only its shards, and DCP reshards on load,
so a checkpoint written by N ranks resumes on M ranks (M = 1 included: the
single-process trainer, whose tensors are plain, loads the same files). The
state is keyed by parameter *name*, never by position or rank:

``policy`` / ``critic``
    ``{name: tensor}``: the float32 master of every trained parameter (the
    parameter itself when it is float32, e.g. FSDP2's float32 shards), the
    model's tensor for the others (the critic's frozen attention); tied
    weights once (the first name).
``actor_optim`` / ``critic_optim``
    ``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}}``: AdamW's state
    for each master, sharded like it.
``trainer`` / ``critic_trainer``
    JSON strings: the actor's optimizer hyper-parameters, the running-mean
    baseline and skipped steps / the critic's optimizer hyper-parameters (its
    learning rate after warm-up steps), LR schedule and skipped steps.

A trainer holding one model (the actor and the critic on ranks of their own,
``runtime.critic_ranks``) writes only that model's keys, each group to its own
directory; :func:`load_sharded` reads the two parts from one directory or two.

On disk: DCP's ``.metadata`` plus one ``__<rank>_0.distcp`` file per writing
rank. Loading writes the masters back into the model weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

from sao.models.cache import atomic_dir
from sao.models.lora import has_lora, plain_state, published_state, save_adapter
from sao.models.value import HEAD_CONFIG, HEAD_FILE, LORA_DIR, ValueModel
from sao.train.precision import MasterWeights
from sao.train.sharded import RankContext, full_state_dict
from sao.train.trainer import Trainer

__all__ = [
    "cast_floating",
    "gathered_update",
    "load_sharded",
    "save_pretrained_gathered",
    "save_sharded",
]

StateDict = dict[str, Any]


def _resharded(model: nn.Module) -> nn.Module:
    """Put every FSDP2 unit back in its sharded form (a root stays gathered
    after a forward), so the parameters seen are the ones the optimizer holds."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return model


def _names(model: nn.Module) -> dict[int, str]:
    """Parameter identity -> its first name (tied weights appear once)."""
    return {id(p): n for n, p in _resharded(model).named_parameters()}


def _weights(model: nn.Module, masters: MasterWeights) -> dict[str, torch.Tensor]:
    """``{name: master or tensor}``: see the module docstring."""
    by_id = {id(p): m for p, m in zip(masters.model_params, masters.params, strict=True)}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in _resharded(model).state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = by_id.get(id(t), t).detach()
    return out


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Materialise the lazily created state of parameters that have none yet
    (a zero-LR step on zero gradients of those parameters alone: no weight
    and no existing state changes), so DCP has tensors to load into."""
    missing = {id(p) for g in optim.param_groups for p in g["params"] if p not in optim.state}
    if not missing:
        return
    grads = {p: p.grad for g in optim.param_groups for p in g["params"]}
    lrs = [g["lr"] for g in optim.param_groups]
    for p in grads:
        p.grad = torch.zeros_like(p) if id(p) in missing else None
    for g in optim.param_groups:
        g["lr"] = 0.0
    optim.step()
    for g, lr in zip(optim.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, grad in grads.items():
        p.grad = grad


def _optim(model: nn.Module, masters: MasterWeights, optim: torch.optim.Optimizer) -> StateDict:
    names = _names(model)
    _init_optim_state(optim)
    state = {
        names[id(p)]: dict(optim.state[m])
        for p, m in zip(masters.model_params, masters.params, strict=True)
    }
    return {"state": state}


def _hyper(optim: torch.optim.Optimizer | None) -> list[dict[str, Any]] | None:
    if optim is None:
        return None
    return [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]


def _state(trainer: Trainer, part: str) -> StateDict:
    """The DCP state of ``trainer``'s ``part`` ("actor" or "critic"; empty when it
    holds no such model). Tensors are the live ones: DCP saves from them and loads
    into them in place."""
    if part == "actor":
        if trainer.policy is None:
            return {}
        _, masters, optim = trainer.actor_parts()
        mean = trainer.running_mean
        extra = {
            "actor_groups": _hyper(optim),
            "actor_sched": None
            if trainer.actor_sched is None
            else trainer.actor_sched.state_dict(),
            "running_mean": None if mean is None else mean.state_dict(),
            "skipped_steps": trainer.bad.total,
        }
        return {
            "policy": _weights(trainer.policy, masters),
            "actor_optim": _optim(trainer.policy, masters, optim),
            "trainer": json.dumps(extra),
        }
    if trainer.critic is None:
        return {}
    assert trainer.critic_weights is not None and trainer.critic_optim is not None
    sched = trainer.critic_sched
    extra = {
        "critic_groups": _hyper(trainer.critic_optim),
        "critic_sched": None if sched is None else sched.state_dict(),
        "critic_fit": trainer.fit.state_dict(),
        "skipped_steps": trainer.bad.total,
    }
    return {
        "critic": _weights(trainer.critic, trainer.critic_weights),
        "critic_optim": _optim(trainer.critic, trainer.critic_weights, trainer.critic_optim),
        "critic_trainer": json.dumps(extra),
    }


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP reads and writes alone, and warns that it
    assumes so on every call: here that is the intent (the 1-rank trainer)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def save_sharded(directory: str | os.PathLike[str], trainer: Trainer) -> Path:
    """Write ``trainer``'s models, optimizers and small state to ``directory``
    with DCP (collective: call on every rank). Returns the path. A trainer
    holding only the actor or only the critic writes only that."""
    path = Path(directory)
    state = _state(trainer, "actor") | _state(trainer, "critic")
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    return path


def load_sharded(
    directory: str | os.PathLike[str],
    trainer: Trainer,
    critic_directory: str | os.PathLike[str] | None = None,
) -> None:
    """Restore what :func:`save_sharded` wrote, on any number of ranks
    (collective). The trainer must be built the same way (same model, preset
    and settings); its world size may differ from the writer's. The critic's
    part comes from ``critic_directory`` when given (a checkpoint whose critic
    trained on ranks of its own), else from ``directory``."""
    sources = {"actor": Path(directory), "critic": Path(critic_directory or directory)}
    for part, path in sources.items():
        state = _state(trainer, part)
        if not state:
            continue
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(
                f"load_sharded: {str(path)!r} holds no DCP checkpoint (no .metadata); pass a "
                "directory written by save_sharded"
            )
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
        key = "trainer" if part == "actor" else "critic_trainer"
        _restore_extra(trainer, json.loads(state[key]))
        weights = trainer.actor_weights if part == "actor" else trainer.critic_weights
        assert weights is not None
        weights.store()


def _restore_extra(trainer: Trainer, extra: StateDict) -> None:
    for optim, groups in (
        (trainer.actor_optim, extra.get("actor_groups")),
        (trainer.critic_optim, extra.get("critic_groups")),
    ):
        if optim is not None and groups is not None:
            for g, saved in zip(optim.param_groups, groups, strict=True):
                g.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    if trainer.critic_sched is not None and extra.get("critic_sched") is not None:
        trainer.critic_sched.load_state_dict(extra["critic_sched"])
    if trainer.actor_sched is not None and extra.get("actor_sched") is not None:
        trainer.actor_sched.load_state_dict(extra["actor_sched"])
    if trainer.running_mean is not None and extra.get("running_mean") is not None:
        trainer.running_mean.load_state_dict(extra["running_mean"])
    if extra.get("critic_fit") is not None:  # (the critic's side; older checkpoints: none)
        trainer.fit.load_state_dict(extra["critic_fit"])
    trainer.bad.total = max(trainer.bad.total, int(extra["skipped_steps"]))


# ---------------------------------------------------------------- export


def cast_floating(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with its floating tensors in ``dtype`` (FSDP2 shards bf16 models
    in float32: this gives the gathered weights back the model's dtype)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def gathered_update(
    policy: nn.Module, ranks: RankContext, *, fused: bool
) -> dict[str, torch.Tensor] | None:
    """What an update sends the engines, gathered from a sharded ``policy`` to
    rank 0 (collective; None on the other ranks): the full state dict, or for
    a LoRA policy its adapted modules' merged weights (``fused``: with the
    siblings a server's fused layers need; :func:`~sao.models.lora.published_state`)."""
    full = full_state_dict(policy)
    if not ranks.is_main:
        return None
    if not has_lora(policy):
        return full
    return dict(published_state(policy, fused=fused, state=full))


def save_pretrained_gathered(
    model: nn.Module,
    directory: str | os.PathLike[str],
    ranks: RankContext,
    *,
    dtype: torch.dtype | None = None,
    export: bool = False,
) -> Path:
    """Gather ``model`` (a policy or a :class:`ValueModel`, sharded or not)
    and write it to one ``directory``, from rank 0, as the single-process
    trainer writes it: in Hugging Face format, or for a LoRA policy its
    adapter in peft's format (a LoRA critic: the adapter beside the head).
    ``export``: a LoRA policy as ``final/`` holds it, the merged model plus
    its adapter in ``adapter/`` (:func:`sao.models.lora.export_policy`).

    Collective: every rank calls it; rank 0 writes (atomically), the others
    wait. ``dtype`` casts floating tensors (FSDP2 trains bf16 models in float32
    shards; pass the model's dtype to export it as loaded)."""
    full = full_state_dict(model)  # collective: rank 0 gets the tensors
    path = Path(directory)
    if ranks.is_main:
        if dtype is not None:
            full = cast_floating(full, dtype)
        if isinstance(model, ValueModel):
            _save_value_model(model, full, path)
        elif not has_lora(model):
            with atomic_dir(path) as tmp:
                cast(PreTrainedModel, model).save_pretrained(tmp, state_dict=full)
        elif not export:
            save_adapter(model, path, state=full)
        else:
            with atomic_dir(path) as tmp:
                plain = plain_state(model, full)
                cast(PreTrainedModel, model).save_pretrained(tmp, state_dict=plain)
                save_adapter(model, tmp / "adapter", state=full)
    ranks.barrier()
    return path


def _save_value_model(critic: ValueModel, full: dict[str, torch.Tensor], path: Path) -> None:
    """:meth:`ValueModel.save_pretrained`'s layout, from a gathered state dict."""
    backbone = {
        k.removeprefix("backbone."): v for k, v in full.items() if k.startswith("backbone.")
    }
    head = {
        k.removeprefix("value_head."): v.float().contiguous()
        for k, v in full.items()
        if k.startswith("value_head.")
    }
    with atomic_dir(path) as tmp:
        if has_lora(critic.backbone):  # the adapter and the trained norm, as saved unsharded
            save_adapter(critic.backbone, tmp / LORA_DIR, state=backbone)
        else:
            critic.backbone.save_pretrained(tmp, state_dict=backbone)
        save_file(head, str(tmp / HEAD_FILE))
        meta = {"hidden_size": critic.value_head.in_features, "dtype": "float32"}
        (tmp / HEAD_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
