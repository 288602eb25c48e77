"""The sharded trainer's builder: N ranks train the actor and the critic with
torch FSDP2 (``fully_shard``), gloo on the CPU, NCCL on GPUs.

Distribution is how objects are built, never a branch in ``Trainer.step``
(ARCHITECTURE.md, scale-out path). The trainer receives a :class:`RankContext`;
on one process it is rank 0 of 1 and every method is the identity, so the
single-process path is the same code with no FSDP. With N ranks:

- every rank receives the *whole* batch and collates it identically; it
  trains its own rows (:func:`sao.train.split.split_rows`: groups whole,
  tokens balanced), padded to the busiest rank's micro-batch count;
- everything that is not row-local is computed on the whole batch on every
  rank: loss denominators, advantages (group baselines, whitening,
  REINFORCE++ and the running mean), batch statistics; per-row model
  outputs (values, old log-probs, the new log-probs for the loss
  statistics) are summed across ranks (:meth:`RankContext.sum_rows`: each
  row is filled by exactly one rank);
- gradients are *summed* across ranks (FSDP2's divide factor set to 1): the
  per-rank losses already carry the global denominators, so the sum over
  ranks and micro-batches is exactly the single-process gradient.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from sao.models.checkpointing import decoder_layers
from sao.models.logprobs import sequence_logprobs
from sao.train.split import (
    micro_batch_rows,
    packed_micro_batch_rows,
    padding_micro_batch,
    select_rows,
    split_rows,
)
from sao.types import Batch

__all__ = [
    "PolicyLogprobs",
    "RankContext",
    "clip_grad_norm",
    "full_state_dict",
    "init_trainer_group",
    "shard",
]


@dataclass(frozen=True)
class RankContext:
    """Where this trainer process sits among ``world_size`` ranks.

    ``RankContext()`` is the single process (rank 0 of 1): :meth:`shard` and
    :meth:`sum_rows` are the identity and :meth:`micro_batches` covers the
    whole batch. Build the N-rank one with :func:`init_trainer_group`.
    """

    rank: int = 0
    world_size: int = 1
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files and logs."""
        return self.rank == 0

    def shard(self, module: nn.Module) -> nn.Module:
        """``module`` sharded over the ranks (:func:`shard`); itself on one process."""
        if self.world_size == 1:
            return module
        assert self.mesh is not None, "an N-rank RankContext needs a device mesh"
        return shard(module, self.mesh)

    def micro_batches(
        self, batch: Batch, token_budget: int, *, packed: bool = False
    ) -> Iterator[tuple[Batch, torch.Tensor]]:
        """This rank's micro-batches of the whole ``batch``: ``(micro_batch,
        row_indices_into_batch)``, then padding ones (empty row index) up to the
        busiest rank's count, so every rank runs as many forward/backward passes.
        ``packed``: micro-batches hold ``token_budget`` real tokens, not padded ones."""
        lengths = batch.attention_mask_BT.sum(dim=1).tolist()
        plan_rows = packed_micro_batch_rows if packed else micro_batch_rows
        plans = [
            plan_rows(lengths, rows, token_budget)
            for rows in split_rows(lengths, batch.group_ids, self.world_size)
        ]
        mine = plans[self.rank]
        for rows in mine:
            yield select_rows(batch, rows)
        for _ in range(max(len(p) for p in plans) - len(mine)):
            yield padding_micro_batch(batch)

    def sum_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over ranks (in place): a whole-batch tensor each of
        whose rows one rank filled (zeros elsewhere) becomes the whole result."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def barrier(self) -> None:
        """Wait for every rank (no-op on one process)."""
        if self.world_size > 1:
            dist.barrier()


def init_trainer_group(
    device: str | torch.device = "cpu", *, timeout_s: float | None = None
) -> RankContext:
    """Join the trainer ranks' process group from the environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``, as set
    by ``torchrun`` or the Ray trainer actors); gloo for the CPU, NCCL for
    CUDA. Without ``WORLD_SIZE`` (or with 1) this is the single process.

    On CUDA each rank uses ``cuda:LOCAL_RANK``. ``timeout_s`` bounds how long
    a collective waits for a rank that died (torch's default otherwise).
    Returns this rank's context with a 1-D device mesh over all ranks.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return RankContext()
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_trainer_group: WORLD_SIZE={world} but {', '.join(missing)} is not set; launch "
            "the trainer ranks with torchrun (or set the variables for every rank)"
        )
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", timeout=timeout)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    return RankContext(rank=dist.get_rank(), world_size=dist.get_world_size(), mesh=mesh)


# ---------------------------------------------------------------- building


class PolicyLogprobs(nn.Module):
    """A causal LM's per-token log-probabilities as one module call.

    ``forward(tokens_BT, attention_mask_BT) -> logp_BT`` (float32 ``[B, T]``,
    :func:`sao.models.logprobs.sequence_logprobs` at ``temperature``). The
    trainer calls the actor through it so that FSDP2's root hooks (which
    gather the embeddings, final norm and LM head) run:
    ``sequence_logprobs`` calls the backbone and the head separately, never
    the model's own ``forward``.
    """

    def __init__(
        self, policy: PreTrainedModel, temperature: float = 1.0, packed: bool = False
    ) -> None:
        super().__init__()
        self.policy = policy
        self.temperature = temperature
        self.packed = packed  # padding-free backbone forward (sao.models.packing)

    def forward(self, tokens_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        logp_BT = sequence_logprobs(
            self.policy,
            tokens_BT,
            attention_mask_BT,
            temperature=self.temperature,
            packed=self.packed,
        )
        return logp_BT.clone()  # not a view: FSDP2 hooks the output for the backward


def _float32_islands(module: nn.Module) -> list[nn.Module]:
    """Modules whose own parameters are all float32 (in a low-precision model:
    the critic's value head); they get their own FSDP unit computing in float32."""
    islands = []
    for m in module.modules():
        own = list(m.parameters(recurse=False))
        if own and all(p.dtype == torch.float32 for p in own):
            islands.append(m)
    return islands


def shard(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Apply FSDP2 to ``module`` in place: one unit per block (decoder layer),
    then the root; returns ``module``.

    - Gradients are **summed** over ranks (divide factor 1, sum-only
      collectives): the trainer's losses use the whole batch's denominators.
    - Frozen parameters (the critic's attention) may share a unit with
      trainable ones: FSDP2 keeps one DTensor per parameter and reduces only
      those that received a gradient.
    - A low-precision model (bf16) is sharded in float32 and gathered in its
      own dtype for compute (``MixedPrecisionPolicy``, gradients reduced in
      float32): the float32 shards are the optimizer's master weights, so
      :class:`~sao.train.precision.MasterWeights` holds no copies. Float32
      leaves (the value head) keep computing in float32.

    Build the optimizer *after* this call: the parameters become DTensors.
    """
    dtypes = {p.dtype for p in module.parameters() if p.dtype != torch.float32}
    if len(dtypes) > 1:
        raise ValueError(f"shard: the model mixes low-precision dtypes {sorted(map(str, dtypes))}")
    compute = next(iter(dtypes), torch.float32)
    islands = _float32_islands(module) if compute != torch.float32 else []
    for p in module.parameters():
        if p.dtype != torch.float32:
            p.data = p.data.float()
    mixed = MixedPrecisionPolicy(
        param_dtype=None if compute == torch.float32 else compute, reduce_dtype=torch.float32
    )
    for island in islands:
        fully_shard(island, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    for block in decoder_layers(module):
        fully_shard(block, mesh=mesh, mp_policy=mixed)
    fully_shard(module, mesh=mesh, mp_policy=mixed)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not mean: denominators are global
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return module


# ---------------------------------------------------------------- using


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` to total 2-norm ``max_norm``; returns
    the pre-clip norm (0-dim, a plain tensor, the same on every rank).

    Sharded gradients (DTensors) give a partial norm per rank; ``full_tensor``
    reduces it, so the clip coefficient and the NaN/inf guard agree on every
    rank (torchtitan's ``clip_grad_norm_`` does the same)."""
    params = list(params)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of ``module`` on the CPU, on rank 0.

    Collective: every rank must call it; ranks other than 0 get ``{}``. A
    module that is not sharded returns detached CPU copies of its state.
    Keys are the module's own (for a policy: the Hugging Face names)."""
    if not any(isinstance(m, FSDPModule) for m in module.modules()):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(module, options=options))
